"""The lightning indexer of DeepSeek sparse attention on the CPU (kind ``indexer``).

The cache holds one key per token, [block, offset in block, head_size], in its own
KV-cache group beside the sparse-MLA layer's latent entries. A step writes the new
keys, then scores every query against its sequence's keys,
``Σ_h w[t, h] · relu(scale · q[t, h]·key_j)`` in float32, and keeps the positions of
the ``index_topk`` best at or before the query's own.

The step's queries are padded to [sequences, longest chunk, heads, head_size]
against each sequence's gathered keys [sequences, longest sequence, head_size], one
batched product with no loop over sequences; the query rows go in chunks that bound
the [sequences, rows, heads, keys] score tensor. A step whose sequences all fit in
``index_topk`` only writes its keys: every query selects all of its positions, which
the sparse-MLA backend reads as dense attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.interfaces.attention import (
    INDEXER,
    AttentionBackend,
    AttentionCapabilities,
    CommonAttentionMetadata,
)

# score tensors of at most this many (sequence, query row, head, key) elements at a time
SCORE_ELEMENTS = 1 << 24


@dataclass
class CpuIndexerMetadata:
    common: CommonAttentionMetadata
    token_seq: torch.Tensor  # [T] the sequence of each new token
    token_row: torch.Tensor  # [T] its row within the sequence's chunk
    key_slots: torch.Tensor | None  # [B, max_seq_len] cache slot of each key position; None: no selection


class CpuIndexer(AttentionBackend):
    name = "cpu_indexer"
    capabilities = AttentionCapabilities(
        kinds=frozenset({INDEXER}),
        platforms=frozenset({"cpu"}),
        dtypes=frozenset({"float32", "bfloat16"}),
    )

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        # [block, offset in block, key]
        return (num_blocks, self.block_size, self.spec.head_size)

    def gather_kv(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys held in cache ``slots`` [n, 1, head_size] and an empty value tensor: the
        indexer caches no values."""
        keys = kv_cache.view(-1, 1, self.spec.head_size)[slots]
        return keys, keys.new_empty(keys.shape[0], 0, self.spec.head_size)

    def scatter_kv(self, kv_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> None:
        """Writes the keys ``k`` [n, 1, head_size] into cache ``slots``; ``v`` must be None or empty."""
        if v is not None and v.numel():
            raise ValueError(f"cpu_indexer caches no values: got v of shape {tuple(v.shape)}; pass None or an empty v.")
        kv_cache.view(-1, 1, self.spec.head_size)[slots] = k

    def build_metadata(self, common: CommonAttentionMetadata) -> CpuIndexerMetadata:
        device = common.query_lens.device
        token_seq, token_row = common.token_seq, common.token_row
        key_slots = None
        if common.max_seq_len > self.spec.index_topk:
            bs = common.block_size
            key_pos = torch.arange(common.max_seq_len, device=device)
            key_slots = common.block_tables[:, key_pos // bs] * bs + key_pos % bs
        return CpuIndexerMetadata(common, token_seq, token_row, key_slots)

    def forward(self, q, k, v, kv_cache, metadata):
        """An indexer selects positions (:meth:`forward_index`); it does not attend."""
        raise NotImplementedError("cpu_indexer selects positions (forward_index); it does not attend")

    def forward_index(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        weights: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: CpuIndexerMetadata,
    ) -> torch.Tensor | None:
        """q: [T, H, D]; k: [T, 1, D] new keys; weights: [T, H]. Returns [T, index_topk]
        positions (-1 padding), or None when no sequence is longer than index_topk."""
        spec, common = self.spec, metadata.common
        cached = kv_cache.view(-1, spec.head_size)
        cached.index_copy_(0, common.slot_mapping, k.reshape(-1, spec.head_size))
        if metadata.key_slots is None:
            return None
        num_seqs, max_len, topk = common.num_seqs, common.max_seq_len, spec.index_topk
        seq, row = metadata.token_seq, metadata.token_row
        keys = cached[metadata.key_slots].float()  # [B, L, D]
        queries = q.new_zeros(num_seqs, common.max_query_len, spec.num_heads, spec.head_size, dtype=torch.float32)
        queries[seq, row] = q.float()
        head_weights = weights.new_zeros(num_seqs, common.max_query_len, spec.num_heads, dtype=torch.float32)
        head_weights[seq, row] = weights.float()
        query_pos = common.context_lens[:, None] + torch.arange(common.max_query_len, device=q.device)  # [B, Q]
        key_pos = torch.arange(max_len, device=q.device)
        selected = torch.full((num_seqs, common.max_query_len, topk), -1, dtype=torch.int64, device=q.device)
        width = min(topk, max_len)
        rows = max(1, SCORE_ELEMENTS // (num_seqs * spec.num_heads * max_len))
        for start in range(0, common.max_query_len, rows):
            part = slice(start, start + rows)
            scores = torch.einsum("bqhd,bld->bqhl", queries[:, part], keys).mul_(spec.scale).relu_()
            scores = torch.einsum("bqhl,bqh->bql", scores, head_weights[:, part])  # [B, rows, L]
            scores.masked_fill_(key_pos[None, None, :] > query_pos[:, part, None], float("-inf"))
            best, positions = scores.topk(width, dim=-1)
            selected[:, part, :width] = positions.masked_fill_(best == float("-inf"), -1)
        return selected[seq, row]
