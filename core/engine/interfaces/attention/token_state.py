"""The contract of a token-state cache (kind ``token_state``): per-token values a model stores
and reads back itself by position, paged like the KV caches but never attended to.

The engine builds one per ``token_state`` KV-cache group (the core's
``engine.runtime.token_state.TokenStateCache`` serves every platform) and uses it as it uses an
attention backend: ``__init__(spec, block_size, dtype, device)``, :meth:`kv_cache_shape`,
:meth:`cache_dtype`, :meth:`build_metadata` once per step, and :meth:`gather_kv` /
:meth:`scatter_kv` for KV tiers. A model reaches :meth:`store` and :meth:`gather` through
``ForwardContext.store`` / ``ForwardContext.gather``.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch

from engine.interfaces.attention.backend import AttentionBackend


class TokenStateBackend(AttentionBackend):
    """One ``spec.head_size`` vector cached per token in the shared block numbering (``spec.kind``
    ``token_state``), so that it follows requests through chunked prefill, preemption and
    prefix caching like keys do."""

    @abstractmethod
    def store(self, values: torch.Tensor, kv_cache: torch.Tensor, metadata: Any) -> None:
        """Write ``values`` [T, head_size] (one row per new token of the step, in batch order)
        at the step's slots, cast to ``kv_cache``'s dtype. Mutates ``kv_cache`` only."""

    @abstractmethod
    def gather(self, kv_cache: torch.Tensor, metadata: Any, positions: torch.Tensor) -> torch.Tensor:
        """[T, m, head_size] in ``kv_cache``'s dtype: for each new token, the values at
        ``positions`` [T, m] (int64, within the token's own sequence, below its length,
        reached through its block table), zeros where a position is -1. Mutates nothing."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: None, kv_cache: torch.Tensor, metadata: Any) -> torch.Tensor:
        """Token states are stored and gathered, never attended to."""
        raise NotImplementedError("token_state caches are read with gather(), not attended to")
