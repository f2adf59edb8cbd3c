"""The Model interface: a model family's network, built from ``config.json``."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ClassVar, Iterable

import torch

from engine.distributed.parallel_state import SINGLE, TensorParallel
from engine.interfaces.attention import AttentionSpec
from engine.model_config import HFConfig

if TYPE_CHECKING:
    from engine.interfaces.forward_context import ForwardContext


@dataclass(frozen=True)
class ModelInit:
    """What a model's constructor receives: the parsed ``config.json``, the
    compute dtype, the device its parameters live on and ``tp``, this rank's
    tensor-parallel group (:data:`SINGLE`, one rank, unless the model declares
    ``supports_tensor_parallel``). The model passes ``tp`` to every layer it
    builds that shards (``tp=init.tp``) and counts this rank's heads by it."""

    config: HFConfig
    dtype: torch.dtype
    device: torch.device
    tp: TensorParallel = SINGLE


class Model(torch.nn.Module, ABC):
    """A causal LM over a flattened batch of tokens (no padding).

    Constructed as ``cls(init: ModelInit)``; the engine then streams the
    checkpoint into :meth:`load_weights`, checks every parameter was filled, and
    calls :meth:`kv_cache_specs` to size the cache.
    """

    # A model family whose checkpoints ship their prompt format as code, not as a tokenizer chat
    # template, sets this to a function ``(messages, *, add_generation_prompt, options, tools) -> str``:
    # ``messages`` are dicts with ``role`` and ``content`` (assistant turns may carry
    # ``reasoning_content`` and ``tool_calls``: ``[{"id", "type": "function", "function": {"name",
    # "arguments": dict}}]``; ``tool`` turns carry ``tool_call_id``), ``options`` the request's
    # ``chat_template_kwargs`` plus its ``reasoning_effort``, ``tools`` the declared functions as
    # OpenAI writes them (``[{"type": "function", "function": {...}}]``, or None); it raises
    # ``ValueError`` for what it cannot express (a 400 reply). The chat endpoints then use it
    # instead of the tokenizer's template.
    chat_encoder: ClassVar[Callable[..., str] | None] = None
    # The registered names of the family's tool-call and reasoning parsers, which
    # ``--tool-call-parser auto`` and ``--reasoning-parser auto`` pick (None: the family has none).
    tool_parser: ClassVar[str | None] = None
    reasoning_parser: ClassVar[str | None] = None
    # A model with more than one residual stream (DeepSeek-V4) sets this and, while the engine
    # sets ``keep_pre_head_hidden_states``, stores each forward's hidden states before its final
    # collapse and norm in ``pre_head_hidden_states`` [T, ...] (what its MTP layers read).
    provides_pre_head_hidden_states: ClassVar[bool] = False
    keep_pre_head_hidden_states: bool = False

    @abstractmethod
    def kv_cache_specs(self) -> list[AttentionSpec]:
        """One spec per attention layer, in the order of the ``layer_index`` the
        model's attention layers pass to ``ctx``."""

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids, positions: [T] int64. Returns hidden states [T, hidden_size]
        in the compute dtype. Writes this step's K/V into the caches held by ``ctx``."""

    @abstractmethod
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states: [N, hidden_size] -> logits [N, vocab_size]."""

    def compute_greedy_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """hidden_states: [N, hidden_size] -> each row's greedy token ([N] int64), exactly
        ``argmax(compute_logits(hidden_states))`` (the first of equal logits), where the model
        can pick it without the logits (``engine.layers.linear.gather_argmax``); None (the
        default) otherwise. The runner asks when every request of a step samples greedily and
        nothing reads or changes the logits."""
        return None

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Consume ``(checkpoint_name, tensor)`` pairs, remapping names as needed.

        Returns the names of the model's own parameters (``named_parameters``
        keys) that were filled. Raises ``KeyError`` naming a checkpoint tensor
        the model has no place for.
        """
