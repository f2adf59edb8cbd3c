"""``y = x · dequant(W)ᵀ + b`` for an MXFP8 weight, in Triton, the weight dequantized
tile by tile inside the GEMM loop (never whole in memory).

One program per [BLOCK_M, BLOCK_N] tile of ``y``, walking K ``BLOCK_K`` (a multiple of
32) at a time: it loads the activations, the e4m3 elements and the tile's
[BLOCK_N, BLOCK_K / 32] scales, multiplies each 32-wide block of elements by its
factor ``2^(s - 127)`` and accumulates the product in float32. The operands of
``tl.dot`` are float32: with float32 activations it computes in IEEE float32; with
16-bit ones in TF32, which is exact for them, as both a bf16 / fp16 activation
and a dequantized e4m3 element fit in TF32's 11 significant bits.

Imports Triton: loaded only when a layer runs on a device Triton drives (xpu, cuda).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine_xpu.mxfp8 import BLOCK, check_mxfp8, e8m0_bytes, num_blocks


@triton.jit
def _e8m0_to_float(s):
    """int32 biased exponents -> float32 ``2^(s - 127)`` from their bits (``2^-127`` is
    subnormal; 255 is NaN)."""
    bits = tl.where(s == 0, 0x400000, s << 23)
    bits = tl.where(s == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _mxfp8_gemm(
    x,
    w,
    scales,
    bias,
    y,
    M,
    N,
    K,
    num_groups,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """x: [M, K] (unit stride along K); w: [N, K] float8_e4m3fn; scales: [N, num_groups]
    uint8; bias: [N]; y: [M, N], written in its dtype."""
    GROUPS: tl.constexpr = BLOCK_K // 32
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_g = tl.arange(0, GROUPS)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        mask_k = k < K
        a = tl.load(x + offs_m[:, None] * stride_xm + k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(w + offs_n[:, None] * stride_wn + k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        group = k0 // 32 + offs_g
        s = tl.load(
            scales + offs_n[:, None] * stride_sn + group[None, :],
            mask=mask_n[:, None] & (group < num_groups)[None, :],
            other=127,
        )
        factor = _e8m0_to_float(s.to(tl.int32))  # [BLOCK_N, GROUPS]
        # dequantize: each 32-wide block of a row times its factor
        b = tl.reshape(tl.reshape(b.to(tl.float32), (BLOCK_N, GROUPS, 32)) * factor[:, :, None], (BLOCK_N, BLOCK_K))
        acc += tl.dot(a.to(tl.float32), tl.trans(b), input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y + offs_m[:, None] * stride_ym + offs_n[None, :],
        acc.to(y.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )


def mxfp8_linear(
    x: torch.Tensor,
    elements: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    block_m: int | None = None,
    block_n: int = 64,
    block_k: int = 64,
) -> torch.Tensor:
    """x [..., K] (float32 / bfloat16 / float16), elements float8_e4m3fn [N, K], scales
    uint8 or float8_e8m0fnu [N, ceil(K / 32)], bias [N] or None -> y [..., N] in x's
    dtype. ``block_k`` must be a multiple of 32; ``block_m`` defaults to the smallest
    of 16, 32, 64 that holds the rows (decode batches are small)."""
    check_mxfp8(elements, scales)
    if block_k % BLOCK:
        raise ValueError(f"block_k must be a multiple of {BLOCK} (one scale per {BLOCK} elements), got {block_k}.")
    n, k = elements.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {k}.")
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    elements = elements if elements.stride(1) == 1 else elements.contiguous()
    codes = e8m0_bytes(scales)
    codes = codes if codes.stride(1) == 1 else codes.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y.view(*x.shape[:-1], n)
    if block_m is None:
        block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _mxfp8_gemm[grid](
        rows,
        elements,
        codes,
        bias if bias is not None else y,
        y,
        m,
        n,
        k,
        num_blocks(k),
        rows.stride(0),
        elements.stride(0),
        codes.stride(0),
        y.stride(0),
        HAS_BIAS=bias is not None,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return y.view(*x.shape[:-1], n)
