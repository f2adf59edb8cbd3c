"""The SpecProposer interface: draft tokens for speculative decoding."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Sequence

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DraftRequest:
    """One running request as a proposer sees it (read-only)."""

    request_id: str
    token_ids: Sequence[int]  # prompt followed by the output so far


@dataclass
class Drafts:
    """Up to ``k`` draft token ids per request (lists may be shorter or empty) and,
    optionally, the draft probabilities of each proposed token ([k_i, vocab])."""

    token_ids: list[list[int]]
    probs: list[torch.Tensor] | None = None


class SpecProposer(ABC):
    """Proposes draft tokens; the core verifies them against the target model, so
    a proposer can make decoding faster or slower but never change its output.

    ``hidden_state_layers``: target layer indices whose hidden states the
    proposer wants passed to :meth:`propose` (empty: none).
    """

    name: ClassVar[str]
    hidden_state_layers: ClassVar[tuple[int, ...]] = ()

    @abstractmethod
    def propose(
        self, requests: Sequence[DraftRequest], num_tokens: int, hidden_states: dict[int, torch.Tensor] | None = None
    ) -> Drafts:
        """Return drafts for every request, in order, at most ``num_tokens`` each."""
