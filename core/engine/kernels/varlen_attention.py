"""Paged attention through a flash-attention ``flash_attn_varlen_func`` (flash-attn's own, or a
kernel library with its interface: AMD's AITER).

The cache is the engine's conventional layout, ``[2, blocks, block_size, Hkv, D]`` (the same
as ``triton_paged``). Each step writes the new keys and values into it, gathers every
sequence's keys and values (cached prefix and new tokens) into one packed varlen batch, and
calls ``flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
max_seqlen_k, dropout_p=0.0, softmax_scale=, causal=True, window_size=)``, whose causal mask
is aligned to the bottom right (the last query row sees every key; flash-attn 2.1 and later),
so a prefill chunk after a cached prefix and a decode step are the same call. A sliding
window of ``W`` keys is ``window_size=(W - 1, 0)``.

The gather sizes its output by the step's token counts, read on the host: these backends
build their metadata with a host synchronisation and so cannot be captured in a device graph
(``AttentionCapabilities.graph_capturable`` is False; decode steps then run eagerly).
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Callable

import torch

from engine.interfaces.attention import CommonAttentionMetadata, PagedAttentionBackend


@dataclass
class VarlenMetadata:
    common: CommonAttentionMetadata
    kv_slots: torch.Tensor  # [sum(seq_lens)] the cache slot of each key, sequence after sequence
    cu_seqlens_k: torch.Tensor  # [B + 1] int32
    cu_seqlens_q: torch.Tensor  # [B + 1] int32


def varlen_metadata(common: CommonAttentionMetadata) -> VarlenMetadata:
    """The cache slots of every sequence's keys, positions 0 .. seq_len - 1 in order."""
    device = common.seq_lens.device
    seq = torch.repeat_interleave(torch.arange(common.num_seqs, device=device), common.seq_lens)
    starts = torch.cumsum(common.seq_lens, 0) - common.seq_lens
    position = torch.arange(seq.shape[0], device=device) - starts[seq]
    block = common.block_tables[seq, position // common.block_size]
    cu_seqlens_k = torch.zeros(common.num_seqs + 1, dtype=torch.int32, device=device)
    cu_seqlens_k[1:] = torch.cumsum(common.seq_lens, 0)
    return VarlenMetadata(
        common,
        block * common.block_size + position % common.block_size,
        cu_seqlens_k,
        common.query_start_loc.to(torch.int32),
    )


class VarlenFlashAttention(PagedAttentionBackend):
    """A paged backend over a ``flash_attn_varlen_func`` (see the module docstring): a subclass
    sets ``name`` and ``capabilities`` and returns the function from :meth:`load_kernel`,
    raising ``RuntimeError`` that says how to get it when it cannot."""

    def __init__(self, spec, block_size: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(spec, block_size, dtype, device)
        self.varlen_attention = self.load_kernel()

    @abstractmethod
    def load_kernel(self) -> Callable[..., torch.Tensor]:
        """The library's ``flash_attn_varlen_func``."""

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (2, num_blocks, self.block_size, self.spec.num_kv_heads, self.spec.head_size)

    def build_metadata(self, common: CommonAttentionMetadata) -> VarlenMetadata:
        return varlen_metadata(common)

    def forward(self, q, k, v, kv_cache: torch.Tensor, metadata: VarlenMetadata) -> torch.Tensor:
        spec, common = self.spec, metadata.common
        keys = kv_cache[0].view(-1, spec.num_kv_heads, spec.head_size)
        values = kv_cache[1].view(-1, spec.num_kv_heads, spec.head_size)
        keys.index_copy_(0, common.slot_mapping, k)
        values.index_copy_(0, common.slot_mapping, v)
        window = (spec.sliding_window - 1, 0) if spec.sliding_window else (-1, -1)
        out = self.varlen_attention(
            q,
            keys[metadata.kv_slots],
            values[metadata.kv_slots],
            metadata.cu_seqlens_q,
            metadata.cu_seqlens_k,
            common.max_query_len,
            common.max_seq_len,
            dropout_p=0.0,
            softmax_scale=spec.scale,
            causal=True,
            window_size=window,
        )
        return out.to(q.dtype)
