"""The contracts of multi-head latent attention (kind ``mla``) and of its sparse form over the
positions an indexer selected (kind ``sparse_mla``)."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch

from engine.interfaces.attention.backend import AttentionBackend


class MLAAttentionBackend(AttentionBackend):
    """A backend of kind ``mla``: one latent entry cached per token, no separate values
    (``spec.head_size`` the entry's size, its first ``spec.latent_size`` dims the value)."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: None, kv_cache: torch.Tensor, metadata: Any) -> torch.Tensor:
        """Write the new entries ``k`` into ``kv_cache`` at the step's slots, then attend (absorbed form).

        q: [T, num_heads, head_size], each head's query already multiplied into the latent
        space (``[W_UKᵀ q_nope; q_rope]``); k: [T, 1, head_size], the new cache entries
        ``[c; k_rope]``; v: None; all in the compute dtype. Each token attends causally to
        its sequence's cached and new entries with scores ``spec.scale · q·entry``; the
        values are the entries' first ``latent_size`` dims. Returns [T, num_heads,
        latent_size] in the compute dtype (the model applies ``W_UV``). Mutates
        ``kv_cache`` only.
        """


class SparseMLAAttentionBackend(AttentionBackend):
    """A backend of kind ``sparse_mla``: MLA's cache (same spec), each query attending only to
    the positions an indexer selected. One serving ``mla`` as well lists
    :class:`MLAAttentionBackend` before this class."""

    @abstractmethod
    def forward_sparse(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: Any,
        indices: torch.Tensor | None,
        lse: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write the new entries, then attend each query to the positions ``indices`` selects.

        q, k and the result are as for :meth:`MLAAttentionBackend.forward`. ``indices``: [T, n]
        int64, positions within each query's own sequence (``0 .. seq_len - 1``, at or before
        the query's position), in any order, padded with ``-1``. ``None`` means every query
        selects all of its causal positions (what an indexer returns when no sequence is
        longer than its ``index_topk``): plain MLA. A row selecting nothing (all ``-1``)
        gets zeros. ``lse``: an optional [T, num_heads] float32 tensor the backend fills
        with each row's ``log Σ exp(scale · q·entry)`` over its selected positions (``-inf``
        for a row selecting nothing), so that a model can merge this attention with another
        (DeepSeek-V4 merges a sliding window, compressed entries and attention sinks).
        Mutates ``kv_cache`` and ``lse`` only.
        """

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: None, kv_cache: torch.Tensor, metadata: Any) -> torch.Tensor:
        """Sparse MLA runs through :meth:`forward_sparse`."""
        raise NotImplementedError(f"{self.name} serves sparse MLA through forward_sparse")
