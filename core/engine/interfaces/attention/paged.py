"""The contract of multi-head, grouped-query and sliding-window attention over a paged cache
(kinds ``mha`` and ``sliding_window``)."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch

from engine.interfaces.attention.backend import AttentionBackend


class PagedAttentionBackend(AttentionBackend):
    """A backend of kinds ``mha`` and/or ``sliding_window``: keys and values cached per token,
    in a layout of the backend's own (:meth:`kv_cache_shape`; the default :meth:`gather_kv`
    serves ``(2, num_blocks, block_size, num_kv_heads, head_size)``)."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: Any,
        *,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write ``k``/``v`` into ``kv_cache`` at the step's slots, then attend.

        q: [T, num_heads, head_size]; k, v: [T, num_kv_heads, head_size], all in
        the compute dtype. Each token attends causally to its sequence's cached
        and new keys (and only the last ``sliding_window`` of them when set), with
        scores ``spec.scale · q·k``; query head ``h`` reads KV head
        ``h // (num_heads // num_kv_heads)``. Returns [T, num_heads, head_size] in
        the compute dtype. Mutates ``kv_cache`` only.

        ``sinks`` [num_heads] float32 comes only for a spec with ``sinks`` set, and only to a
        backend declaring ``capabilities.sinks`` (others may leave the argument out): head
        ``h``'s softmax then runs over its scores and ``sinks[h]``, whose share is dropped, so
        the weights sum to ``1 - p_sink``. A backend without sinks is never called with it.
        """
