"""A paged attention backend in plain torch, against engine's public interface."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.interfaces.attention import (
    MHA,
    SLIDING_WINDOW,
    AttentionBackend,
    AttentionCapabilities,
    CommonAttentionMetadata,
)


@dataclass
class Metadata:
    common: CommonAttentionMetadata
    seq_of_token: torch.Tensor  # [T] sequence index of each new token
    query_pos: torch.Tensor  # [T] position of each new token in its sequence
    key_slots: torch.Tensor  # [B, max_seq_len] cache slot of every key position (0 past the end)


class TorchPagedAttention(AttentionBackend):
    """Gathers each sequence's K/V through the block table; one masked softmax for the batch."""

    name = "example_torch_paged"
    capabilities = AttentionCapabilities(
        kinds=frozenset({MHA, SLIDING_WINDOW}),
        platforms=frozenset({"cpu", "cuda", "rocm", "xpu"}),
        dtypes=frozenset({"float32", "bfloat16", "float16"}),
    )

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        # [K/V, block * block_size, kv heads, head dim]: a flat slot index addresses one token
        return (2, num_blocks * self.block_size, self.spec.num_kv_heads, self.spec.head_size)

    def build_metadata(self, common: CommonAttentionMetadata) -> Metadata:
        device = common.slot_mapping.device
        seq_of_token = torch.repeat_interleave(torch.arange(common.num_seqs, device=device), common.query_lens)
        row = torch.arange(common.num_tokens, device=device) - common.query_start_loc[seq_of_token]
        query_pos = common.context_lens[seq_of_token] + row
        key_pos = torch.arange(common.max_seq_len, device=device)
        blocks = common.block_tables[:, key_pos // common.block_size]  # [B, max_seq_len]
        key_slots = blocks * common.block_size + key_pos % common.block_size
        return Metadata(common, seq_of_token, query_pos, key_slots)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, metadata: Metadata
    ) -> torch.Tensor:
        # q: [T, H, D]; k, v: [T, Hkv, D]; kv_cache: [2, slots, Hkv, D] -> [T, H, D]
        spec, common = self.spec, metadata.common
        kv_cache[0, common.slot_mapping] = k
        kv_cache[1, common.slot_mapping] = v
        keys = kv_cache[0, metadata.key_slots[metadata.seq_of_token]]  # [T, S, Hkv, D]
        values = kv_cache[1, metadata.key_slots[metadata.seq_of_token]]
        group = spec.num_heads // spec.num_kv_heads
        keys = keys.repeat_interleave(group, dim=2).float()  # [T, S, H, D]
        values = values.repeat_interleave(group, dim=2).float()
        scores = torch.einsum("thd,tshd->ths", q.float(), keys) * spec.scale  # [T, H, S]
        key_pos = torch.arange(keys.shape[1], device=q.device)
        allowed = key_pos[None, :] <= metadata.query_pos[:, None]  # causal, and within the sequence
        if spec.sliding_window is not None:
            allowed &= metadata.query_pos[:, None] - key_pos[None, :] < spec.sliding_window
        scores = scores.masked_fill(~allowed[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return torch.einsum("ths,tshd->thd", probs, values).to(q.dtype)
