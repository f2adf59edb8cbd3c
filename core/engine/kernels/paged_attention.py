"""Paged attention in Triton, and the built-in backends that run it on GPU platforms:
``triton_paged`` (MHA / GQA / MQA, sliding window) and ``triton_mla`` (multi-head latent
attention over the latent cache). Checked on the CPU under ``TRITON_INTERPRET=1``.

One kernel serves prefill chunks after a cached prefix and decode steps alike: one program
per (new token, query head) walks that token's keys through its sequence's block table,
``BLOCK_N`` at a time, with an online softmax in float32, and writes the weighted sum of
the values. Grouped-query heads read KV head ``h // (H / Hkv)``; a sliding window starts
the walk at ``position - window + 1``; attention sinks (GPT-OSS) join each head's softmax
after the walk, as one more logit with no value. For MLA the keys are the latent entries of one
KV head and the values their first ``latent_size`` dims (the queries arrive absorbed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.interfaces.attention import (
    MHA,
    MLA,
    SLIDING_WINDOW,
    AttentionBackend,
    AttentionCapabilities,
    CommonAttentionMetadata,
)

GPU_PLATFORMS = frozenset({"cuda", "rocm", "xpu"})
GPU_DTYPES = frozenset({"float32", "bfloat16", "float16"})
FP8_MAX = 448.0  # the largest finite float8_e4m3fn


@triton.jit
def _paged_attention(
    q,
    k_cache,
    v_cache,
    out,
    block_tables,
    token_seq,
    token_pos,
    sinks,
    scale,
    k_scale,
    v_scale,
    window,
    group,
    block_size,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    dk,
    dv,
    BLOCK_N: tl.constexpr,
    BD: tl.constexpr,
    BDV: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.load(token_seq + token)
    pos = tl.load(token_pos + token)
    kv_head = head // group
    d = tl.arange(0, BD)
    dvr = tl.arange(0, BDV)
    query = tl.load(q + token * stride_qt + head * stride_qh + d, mask=d < dk, other=0.0).to(tl.float32) * scale
    start = pos * 0
    if window > 0:
        start = tl.maximum(pos - window + 1, 0)
    running_max = tl.full([], float("-inf"), tl.float32)
    total = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([BDV], dtype=tl.float32)
    for first in range(start, pos + 1, BLOCK_N):
        n = first + tl.arange(0, BLOCK_N)
        valid = n <= pos
        block = tl.load(block_tables + seq * stride_bt + n // block_size, mask=valid, other=0)
        offset = n % block_size
        keys = (
            tl.load(
                k_cache + block[:, None] * stride_kb + offset[:, None] * stride_ks + kv_head * stride_kh + d[None, :],
                mask=valid[:, None] & (d[None, :] < dk),
                other=0.0,
            ).to(tl.float32)
            * k_scale
        )
        scores = tl.where(valid, tl.sum(keys * query[None, :], axis=1), float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=0))
        weights = tl.exp(scores - new_max)
        correction = tl.exp(running_max - new_max)
        values = (
            tl.load(
                v_cache + block[:, None] * stride_vb + offset[:, None] * stride_vs + kv_head * stride_vh + dvr[None, :],
                mask=valid[:, None] & (dvr[None, :] < dv),
                other=0.0,
            ).to(tl.float32)
            * v_scale
        )
        acc = acc * correction + tl.sum(weights[:, None] * values, axis=0)
        total = total * correction + tl.sum(weights, axis=0)
        running_max = new_max
    if HAS_SINKS:  # the head's sink: one more logit in the softmax, no value
        sink = tl.load(sinks + head).to(tl.float32)
        new_max = tl.maximum(running_max, sink)
        correction = tl.exp(running_max - new_max)
        acc = acc * correction
        total = total * correction + tl.exp(sink - new_max)
    tl.store(out + token * stride_ot + head * stride_oh + dvr, acc / total, mask=dvr < dv)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    value_size: int,
    block_tables: torch.Tensor,
    token_seq: torch.Tensor,
    token_pos: torch.Tensor,
    scale: float,
    window: int | None,
    block_n: int = 64,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each new token over its sequence's paged keys and values (cache
    entries, of any dtype, read as float32 times ``k_scale`` / ``v_scale``: an FP8 cache's
    per-tensor factors), and with ``sinks`` [H] each head's sink logit in its softmax.

    q: [T, H, D]; k_cache / v_cache: [blocks, block_size, Hkv, D] views (values' first
    ``value_size`` dims are read); block_tables [B, max_blocks]; token_seq / token_pos [T]: each
    token's sequence and position. Returns [T, H, value_size] float32."""
    num_tokens, num_heads, head_size = q.shape
    num_kv_heads = k_cache.shape[2]
    out = torch.empty(num_tokens, num_heads, value_size, dtype=torch.float32, device=q.device)
    if num_tokens == 0:
        return out
    _paged_attention[(num_tokens, num_heads)](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        token_seq,
        token_pos,
        q if sinks is None else sinks,  # any pointer where there are none: never read
        scale,
        k_scale,
        v_scale,
        window or 0,
        num_heads // num_kv_heads,
        k_cache.shape[1],
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        head_size,
        value_size,
        BLOCK_N=block_n,
        BD=triton.next_power_of_2(head_size),
        BDV=triton.next_power_of_2(value_size),
        HAS_SINKS=sinks is not None,
    )
    return out


@dataclass
class TritonAttentionMetadata:
    common: CommonAttentionMetadata
    token_seq: torch.Tensor  # [T] the sequence of each new token
    token_pos: torch.Tensor  # [T] its position in the sequence


def build_metadata(common: CommonAttentionMetadata) -> TritonAttentionMetadata:
    return TritonAttentionMetadata(common, common.token_seq, common.token_pos)


class TritonPagedAttention(AttentionBackend):
    """MHA / GQA / MQA and sliding-window attention over the conventional cache layout
    ``[2, blocks, block_size, Hkv, D]`` (keys, values)."""

    name = "triton_paged"
    capabilities = AttentionCapabilities(
        kinds=frozenset({MHA, SLIDING_WINDOW}),
        platforms=GPU_PLATFORMS,
        dtypes=GPU_DTYPES,
        kv_cache_dtypes=frozenset({"auto", "fp8"}),
        sinks=True,
    )

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (2, num_blocks, self.block_size, self.spec.num_kv_heads, self.spec.head_size)

    def cache_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float8_e4m3fn if self.kv_cache_dtype == "fp8" else dtype

    def _stored(self, values: torch.Tensor, factor: float, cache: torch.Tensor) -> torch.Tensor:
        """New keys or values as the cache holds them: divided by the cache's factor and
        rounded to e4m3 (clamped to its range) in an FP8 cache, as they are otherwise."""
        if cache.dtype != torch.float8_e4m3fn:
            return values
        return (values.float() / factor).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)

    def build_metadata(self, common: CommonAttentionMetadata) -> TritonAttentionMetadata:
        return build_metadata(common)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TritonAttentionMetadata,
        *,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        spec, common = self.spec, metadata.common
        fp8 = kv_cache.dtype == torch.float8_e4m3fn
        for index, new, factor in ((0, k, self.k_scale), (1, v, self.v_scale)):
            target, stored = kv_cache[index], self._stored(new, factor, kv_cache)
            if fp8:  # index_copy_ has no float8 kernels: the same bytes through uint8 views
                target, stored = target.view(torch.uint8), stored.view(torch.uint8)
            target.view(-1, spec.num_kv_heads, spec.head_size).index_copy_(0, common.slot_mapping, stored)
        out = paged_attention(
            q,
            kv_cache[0],
            kv_cache[1],
            spec.head_size,
            common.block_tables,
            metadata.token_seq,
            metadata.token_pos,
            spec.scale,
            spec.sliding_window,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
            sinks=sinks,
        )
        return out.to(q.dtype)


class TritonMlaAttention(AttentionBackend):
    """Multi-head latent attention (absorbed queries) over ``[blocks, block_size, entry]``: the
    keys are the entries of one KV head, the values their first ``latent_size`` dims."""

    name = "triton_mla"
    capabilities = AttentionCapabilities(kinds=frozenset({MLA}), platforms=GPU_PLATFORMS, dtypes=GPU_DTYPES)

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.block_size, self.spec.head_size)

    def gather_kv(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        entries = kv_cache.view(-1, 1, self.spec.head_size)[slots]
        return entries, entries.new_empty(entries.shape[0], 0, self.spec.head_size)

    def scatter_kv(self, kv_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> None:
        kv_cache.view(-1, 1, self.spec.head_size)[slots] = k

    def build_metadata(self, common: CommonAttentionMetadata) -> TritonAttentionMetadata:
        return build_metadata(common)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: TritonAttentionMetadata,
    ) -> torch.Tensor:
        spec, common = self.spec, metadata.common
        entries = kv_cache.view(-1, spec.head_size)
        entries.index_copy_(0, common.slot_mapping, k.reshape(-1, spec.head_size))
        paged = kv_cache.unsqueeze(2)  # [blocks, block_size, 1, entry]
        out = paged_attention(
            q,
            paged,
            paged,
            spec.latent_size,
            common.block_tables,
            metadata.token_seq,
            metadata.token_pos,
            spec.scale,
            None,
        )
        return out.to(q.dtype)
