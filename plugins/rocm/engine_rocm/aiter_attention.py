"""``aiter_mha``: MHA / GQA / MQA and sliding-window attention through AMD's AITER kernels.

The cache is the engine's conventional layout, ``[2, blocks, block_size, Hkv, D]`` (the same
as ``triton_paged``). Each step writes the new keys and values into it, gathers every
sequence's keys and values (cached prefix and new tokens) into one packed varlen batch, and
runs ``aiter.flash_attn_varlen_func`` over it: AITER's composable-kernel flash attention,
whose causal mask is aligned to the bottom right (the last query row sees every key), so a
prefill chunk after a cached prefix and a decode step are the same call. A sliding window of
``W`` keys is ``window_size=(W - 1, 0)``.

``aiter`` is imported when the backend is built, not when the plugin loads; engine-rocm
prefers this backend only where ``aiter`` imports (see ``RocmPlatform``).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from engine.interfaces.attention import (
    MHA,
    SLIDING_WINDOW,
    AttentionBackend,
    AttentionCapabilities,
    AttentionSpec,
    CommonAttentionMetadata,
)


def import_aiter() -> ModuleType:
    """``aiter``, or a ``RuntimeError`` that says how to get it."""
    try:
        import aiter
    except ImportError as exc:
        raise RuntimeError(
            f"attention backend 'aiter_mha' needs AMD's aiter package, which cannot be imported ({exc}); "
            "install aiter (https://github.com/ROCm/aiter) or choose --attention-backend triton_paged"
        ) from exc
    if not hasattr(aiter, "flash_attn_varlen_func"):
        raise RuntimeError(
            "attention backend 'aiter_mha' needs aiter.flash_attn_varlen_func, which this aiter "
            f"({getattr(aiter, '__version__', 'unknown version')}) lacks; upgrade aiter"
        )
    return aiter


@dataclass
class AiterAttentionMetadata:
    common: CommonAttentionMetadata
    kv_slots: torch.Tensor  # [sum(seq_lens)] the cache slot of each key, sequence after sequence
    cu_seqlens_k: torch.Tensor  # [B + 1] int32
    cu_seqlens_q: torch.Tensor  # [B + 1] int32


def build_metadata(common: CommonAttentionMetadata) -> AiterAttentionMetadata:
    """The cache slots of every sequence's keys, positions 0 .. seq_len - 1 in order."""
    device = common.seq_lens.device
    seq = torch.repeat_interleave(torch.arange(common.num_seqs, device=device), common.seq_lens)
    starts = torch.cumsum(common.seq_lens, 0) - common.seq_lens
    position = torch.arange(seq.shape[0], device=device) - starts[seq]
    block = common.block_tables[seq, position // common.block_size]
    cu_seqlens_k = torch.zeros(common.num_seqs + 1, dtype=torch.int32, device=device)
    cu_seqlens_k[1:] = torch.cumsum(common.seq_lens, 0)
    return AiterAttentionMetadata(
        common,
        block * common.block_size + position % common.block_size,
        cu_seqlens_k,
        common.query_start_loc.to(torch.int32),
    )


class AiterPagedAttention(AttentionBackend):
    """MHA / GQA / MQA and sliding-window attention by ``aiter.flash_attn_varlen_func``
    (half precision, as AITER's kernels are built)."""

    name = "aiter_mha"
    capabilities = AttentionCapabilities(
        kinds=frozenset({MHA, SLIDING_WINDOW}), platforms=frozenset({"rocm"}), dtypes=frozenset({"bfloat16", "float16"})
    )

    def __init__(self, spec: AttentionSpec, block_size: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(spec, block_size, dtype, device)
        self.aiter = import_aiter()

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (2, num_blocks, self.block_size, self.spec.num_kv_heads, self.spec.head_size)

    def build_metadata(self, common: CommonAttentionMetadata) -> AiterAttentionMetadata:
        return build_metadata(common)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AiterAttentionMetadata,
    ) -> torch.Tensor:
        spec, common = self.spec, metadata.common
        keys = kv_cache[0].view(-1, spec.num_kv_heads, spec.head_size)
        values = kv_cache[1].view(-1, spec.num_kv_heads, spec.head_size)
        keys.index_copy_(0, common.slot_mapping, k)
        values.index_copy_(0, common.slot_mapping, v)
        window = (spec.sliding_window - 1, 0) if spec.sliding_window else (-1, -1)
        out = self.aiter.flash_attn_varlen_func(
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
