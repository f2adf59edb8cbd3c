"""Paged attention for MHA/GQA on the CPU.

The native kernel (``csrc/paged_attention.cpp``) reads keys and values in place
through the block tables. Where it cannot be built, the torch path gathers
every sequence's keys and values into a padded [B, max_seq_len] view and runs
one masked scaled-dot-product attention for the whole batch. Either way decode
and prefill (with or without a cached prefix) take one path with no Python loop
over sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.interfaces.attention import (
    MHA,
    SLIDING_WINDOW,
    AttentionBackend,
    AttentionCapabilities,
    CommonAttentionMetadata,
)


@dataclass
class CpuAttentionMetadata:
    common: CommonAttentionMetadata
    token_seq: torch.Tensor  # [T] sequence of each token
    # the torch path only:
    token_row: torch.Tensor | None = None  # [T] row of each token within its sequence's queries
    key_slots: torch.Tensor | None = None  # [B, max_seq_len] cache slot of each key position
    mask: torch.Tensor | None = None  # [B, 1, max_query_len, max_seq_len] True where attention is allowed


class CpuPagedAttention(AttentionBackend):
    name = "cpu_paged"
    capabilities = AttentionCapabilities(
        kinds=frozenset({MHA, SLIDING_WINDOW}),
        platforms=frozenset({"cpu"}),
        dtypes=frozenset({"float32", "bfloat16", "float16"}),
    )

    def __init__(self, spec, block_size, dtype, device) -> None:
        super().__init__(spec, block_size, dtype, device)
        from engine_cpu import native

        self.kernels = native.load()

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        # [K/V, block, offset in block, kv head, head dim]
        return (2, num_blocks, self.block_size, self.spec.num_kv_heads, self.spec.head_size)

    def build_metadata(self, common: CommonAttentionMetadata) -> CpuAttentionMetadata:
        device = common.slot_mapping.device
        token_seq = torch.repeat_interleave(torch.arange(common.num_seqs, device=device), common.query_lens)
        metadata = CpuAttentionMetadata(common=common, token_seq=token_seq)
        if self.kernels is not None:
            return metadata
        max_q, max_k, bs = common.max_query_len, common.max_seq_len, common.block_size
        metadata.token_row = torch.arange(common.num_tokens, device=device) - common.query_start_loc[token_seq]
        key_pos = torch.arange(max_k, device=device)
        metadata.key_slots = common.block_tables[:, key_pos // bs] * bs + key_pos % bs
        # query row r of sequence b sits at position context_lens[b] + r (padding rows clamp
        # to the last real position so that no row is fully masked)
        rows = torch.arange(max_q, device=device)
        query_pos = torch.minimum(common.context_lens[:, None] + rows[None, :], common.seq_lens[:, None] - 1)
        mask = key_pos[None, None, :] <= query_pos[:, :, None]
        window = self.spec.sliding_window
        if window is not None:
            mask &= (query_pos[:, :, None] - key_pos[None, None, :]) < window
        metadata.mask = mask.unsqueeze(1)
        return metadata

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, metadata: CpuAttentionMetadata
    ) -> torch.Tensor:
        spec, common = self.spec, metadata.common
        key_cache = kv_cache[0].view(-1, spec.num_kv_heads, spec.head_size)
        value_cache = kv_cache[1].view(-1, spec.num_kv_heads, spec.head_size)
        key_cache.index_copy_(0, common.slot_mapping, k)
        value_cache.index_copy_(0, common.slot_mapping, v)
        if self.kernels is not None:
            q = q.contiguous()
            out = torch.empty_like(q)
            self.kernels.paged_attention(
                out, q, kv_cache[0], kv_cache[1], common.block_tables, common.query_start_loc, common.context_lens,
                metadata.token_seq, spec.scale, spec.sliding_window or 0,
            )
            return out
        return self._forward_torch(q, key_cache, value_cache, metadata)

    def _forward_torch(
        self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, metadata: CpuAttentionMetadata
    ) -> torch.Tensor:
        spec, common = self.spec, metadata.common
        # keys, values: [B, Hkv, max_seq_len, D]
        keys = key_cache[metadata.key_slots].transpose(1, 2)
        values = value_cache[metadata.key_slots].transpose(1, 2)
        # queries: [T, H, D] -> padded [B, H, max_query_len, D]
        padded = q.new_zeros(common.num_seqs, common.max_query_len, spec.num_heads, spec.head_size)
        padded[metadata.token_seq, metadata.token_row] = q
        out = F.scaled_dot_product_attention(
            padded.transpose(1, 2),
            keys,
            values,
            attn_mask=metadata.mask,
            scale=spec.scale,
            enable_gqa=spec.num_heads != spec.num_kv_heads,
        )
        # [B, H, max_query_len, D] -> [T, H, D]
        return out.transpose(1, 2)[metadata.token_seq, metadata.token_row]
