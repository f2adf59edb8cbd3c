"""The SpecProposer interface: draft tokens for speculative decoding."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Sequence

if TYPE_CHECKING:
    import torch

# ``hidden_state_layers`` entry for the target's final hidden states (after its last norm,
# what the LM head reads)
FINAL_HIDDEN_STATES = -1
# the target's hidden states before its final collapse and norm, for models that keep more than
# one stream (DeepSeek-V4's hyper-connection streams, flattened: [hc_mult · hidden]); only models
# whose class sets ``provides_pre_head_hidden_states`` have them
PRE_HEAD_HIDDEN_STATES = -2


@dataclass(frozen=True)
class ProposerInit:
    """What a proposer is built from.

    - ``config``: the user's ``--speculative-config`` JSON object (``{}`` when not
      given); raise ``ValueError`` naming a key that is unusable.
    - ``target_model_path``: the target checkpoint's directory; ``vocab_size`` its
      vocabulary; ``dtype`` / ``device`` the target's compute dtype and device.
    - ``components``: the engine's registries (``components.models.get(architecture)``
      loads a draft model the way the engine loads the target).
    - ``platform``: the selected :class:`engine.interfaces.Platform`.
    """

    config: dict[str, Any]
    target_model_path: Path
    vocab_size: int
    dtype: torch.dtype
    device: torch.device
    components: Any = None
    platform: Any = None
    block_size: int = 16


@dataclass(frozen=True)
class DraftRequest:
    """One running request as a proposer sees it (read-only).

    ``token_ids`` is the prompt followed by every output token accepted so far (a
    tuple: a proposer cannot change the request); it may be shorter than at the last
    call when the request was preempted and resumed, and its tail differs from the
    drafts proposed last time wherever those were rejected.
    """

    request_id: str
    token_ids: tuple[int, ...]


@dataclass
class Drafts:
    """Up to ``num_tokens`` draft token ids per request, in request order (a list may
    be shorter or empty), and optionally each draft's probability under the proposer:
    ``probs[i]`` is ``[len(token_ids[i]), vocab]`` (rows sum to 1). Without probabilities
    a draft counts as certain, which is lossless too, only less often accepted when
    sampling."""

    token_ids: list[list[int]]
    probs: list[torch.Tensor] | None = field(default=None)


class SpecProposer(ABC):
    """Proposes draft tokens; the core verifies them against the target model in one
    forward pass, so a proposer can make decoding faster or slower but never change
    its output (greedy tokens or the sampled distribution).

    Constructed as ``cls(init: ProposerInit)`` once per engine.
    ``hidden_state_layers``: target hidden states the proposer wants passed to
    :meth:`propose`; the engine supports ``(FINAL_HIDDEN_STATES,)``, the target's last
    hidden state of each request (the row that produced its newest token), or
    ``(PRE_HEAD_HIDDEN_STATES,)`` for a target that provides them. An instance may set
    its own after construction (the engine reads it then).
    """

    name: ClassVar[str]
    hidden_state_layers: ClassVar[tuple[int, ...]] = ()

    def __init__(self, init: ProposerInit) -> None:
        self.init = init

    @abstractmethod
    def propose(
        self, requests: Sequence[DraftRequest], num_tokens: int, hidden_states: dict[int, torch.Tensor] | None = None
    ) -> Drafts:
        """Drafts for every request, in order, at most ``num_tokens`` each.
        ``hidden_states[layer]``: ``[len(requests), hidden]`` when asked for."""

    def remove(self, request_ids: Sequence[str]) -> None:
        """Forget per-request state of requests that finished or were aborted (default: none kept).
        Ids never drafted for (a request aborted while waiting) and ids already removed are
        accepted and ignored."""
