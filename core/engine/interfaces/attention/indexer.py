"""The contract of DeepSeek sparse attention's lightning indexer (kind ``indexer``): it caches
one key per token and selects each query's top-k positions for sparse MLA."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch

from engine.interfaces.attention.backend import AttentionBackend


class IndexerBackend(AttentionBackend):
    """A backend of kind ``indexer``: one key cached per token (``spec.num_kv_heads`` 1,
    ``spec.head_size`` the indexer's head dim), ``spec.index_topk`` positions selected per query."""

    @abstractmethod
    def forward_index(
        self, q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, kv_cache: torch.Tensor, metadata: Any
    ) -> torch.Tensor | None:
        """Write the new keys ``k`` into ``kv_cache``, then select each query's ``index_topk`` positions.

        q: [T, num_heads, head_size]; k: [T, 1, head_size] the new keys, both in the compute
        dtype; weights: [T, num_heads] float32. The score of the key at position ``j`` for
        query ``t`` is ``Σ_h weights[t, h] · relu(scale · q[t, h]·key_j)``, over the positions
        ``j`` at or before the query's own (float32 accumulation). Returns [T, index_topk]
        int64: the positions of each query's ``index_topk`` highest scores, in any order (ties
        broken either way), padded with ``-1`` where the query has fewer positions; or
        ``None`` when no sequence of the step is longer than ``index_topk`` (every query then
        selects all of its positions). Mutates ``kv_cache`` only.
        """

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: None, kv_cache: torch.Tensor, metadata: Any) -> torch.Tensor:
        """An indexer selects positions (:meth:`forward_index`); it does not attend."""
        raise NotImplementedError(f"{self.name} selects positions (forward_index); it does not attend")
