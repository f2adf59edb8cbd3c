"""``y = x · (W · S)ᵀ + b`` for an FP8 (e4m3) weight with block scales, in Triton.

The weight ``W`` [N, K] is ``float8_e4m3fn``; ``S`` holds one float32 factor per block of
``block = (block_n, block_k)`` of it: DeepSeek's checkpoints use 128 × 128 blocks
(``weight_scale_inv`` [⌈N/128⌉, ⌈K/128⌉]); compressed-tensors ``float-quantized`` weights a
factor per output channel (``block = (1, K)``, scales [N, 1]) or one for the whole tensor
(``block = (N, K)``, scales [1, 1]). One kernel serves the three.

Two ways to meet the activations:

- ``quantize_activations=True`` (W8A8, as DeepSeek's inference code runs): each row of ``x``
  is cut into groups of ``block_k`` (the whole row when a weight block spans K), each group
  quantized to e4m3 with its own factor (:func:`quantize_fp8_groups`), and ``tl.dot`` takes
  the two FP8 tiles: FP8 tensor cores on sm89+. Each K tile's product is scaled by the
  row's and the weight block's factors before it is added to the float32 accumulator.
- ``quantize_activations=False`` (W8A16): ``x`` stays in its dtype; each weight tile is
  widened (every e4m3 value is exact in bf16, fp16 and fp32) and the dot runs in x's dtype,
  the tile's product scaled by its weight factors.

One program per [BLOCK_M, BLOCK_N] tile of ``y``, walking K ``BLOCK_K`` at a time; a K tile
never straddles two scale blocks (``block_k`` is a multiple of ``BLOCK_K``, or a block spans
all of K). With ``dot_fp32`` both dot operands are float32: what the Triton interpreter
needs (its ``tl.dot`` on 16-bit and FP8 operands is not exact), and exact for these values,
which fit float32's significand.

Imports Triton: loaded only where a layer runs on a device Triton drives.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
MIN_SCALE = 1e-12  # an all-zero group still gets a finite factor


def quantize_fp8_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 factors [M, ⌈K/group⌉]): each ``group`` consecutive
    values of a row divided by their largest magnitude / 448 and rounded to e4m3 (the
    dynamic per-token-group quantization DeepSeek's and vLLM's FP8 GEMMs run on activations),
    so that ``q · factor`` is ``x`` within e4m3's rounding."""
    if x.dim() != 2:
        raise ValueError(f"quantize_fp8_groups takes [M, K] rows, got shape {tuple(x.shape)}.")
    if group < 1:
        raise ValueError(f"group must be positive, got {group}.")
    m, k = x.shape
    groups = -(-k // group)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    scales = (padded.abs().amax(dim=-1) / E4M3_MAX).clamp(min=MIN_SCALE)
    q = (padded / scales[:, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(m, groups * group)[:, :k].contiguous(), scales


@triton.jit
def _fp8_block_gemm(
    x,
    x_scales,
    w,
    w_scales,
    bias,
    y,
    M,
    N,
    K,
    block_n,
    block_k,
    x_group,
    stride_xm,
    stride_xsm,
    stride_wn,
    stride_wsn,
    stride_ym,
    ACT_FP8: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """x: [M, K] (e4m3 with x_scales [M, ⌈K/x_group⌉] when ACT_FP8, else bf16/fp16/fp32);
    w: [N, K] e4m3; w_scales: [⌈N/block_n⌉, ⌈K/block_k⌉] float32; bias [N]; y [M, N]."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    scale_rows = offs_n // block_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        mask_k = k < K
        a = tl.load(x + offs_m[:, None] * stride_xm + k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(w + offs_n[:, None] * stride_wn + k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        if DOT_FP32:
            part = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
        elif ACT_FP8:
            part = tl.dot(a, tl.trans(b))  # FP8 x FP8, float32 accumulation
        else:
            part = tl.dot(a, tl.trans(b.to(a.dtype)))
        w_factor = tl.load(w_scales + scale_rows * stride_wsn + k0 // block_k, mask=mask_n, other=0.0)
        if ACT_FP8:
            x_factor = tl.load(x_scales + offs_m * stride_xsm + k0 // x_group, mask=mask_m, other=0.0)
            part = part * x_factor[:, None]
        acc += part * w_factor[None, :]
    if HAS_BIAS:
        acc += tl.load(bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y + offs_m[:, None] * stride_ym + offs_n[None, :],
        acc.to(y.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )


def check_block_scales(weight: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The scales as a [⌈N/block_n⌉, ⌈K/block_k⌉] float32 matrix (a scalar or [N] per-channel
    vector reshaped); a mismatch is a ValueError that names both shapes."""
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(f"an FP8 weight must be 2-D float8_e4m3fn, got {weight.dtype} {tuple(weight.shape)}.")
    n, k = weight.shape
    block_n, block_k = block
    if block_n < 1 or block_k < 1:
        raise ValueError(f"block sizes must be positive, got {block}.")
    expected = (-(-n // block_n), -(-k // block_k))
    if scales.numel() == expected[0] * expected[1] and scales.dim() <= 2:
        return scales.reshape(expected).float().contiguous()
    raise ValueError(
        f"a weight of shape {(n, k)} in blocks of {block} needs {expected} scales, got {tuple(scales.shape)}."
    )


def fp8_block_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None = None,
    *,
    quantize_activations: bool = True,
    block_m: int | None = None,
    block_n: int = 64,
    block_k: int = 64,
    dot_fp32: bool | None = None,
) -> torch.Tensor:
    """x [..., K] (bf16 / fp16 / fp32), weight e4m3 [N, K], scales one float32 factor per
    ``block`` of the weight, bias [N] or None -> y [..., N] in x's dtype. ``block_k`` (the
    K tile) must divide the weight's scale block along K unless that block spans K;
    ``block_m`` defaults to the smallest of 16, 32, 64 that holds the rows. ``dot_fp32``
    defaults to on under the Triton interpreter (``TRITON_INTERPRET=1``)."""
    n, k = weight.shape
    w_scales = check_block_scales(weight, scales, block)
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {k}.")
    scale_k = min(block[1], k)
    if scale_k < k and scale_k % block_k:
        raise ValueError(
            f"the K tile ({block_k}) must divide the weight's scale block along K ({block[1]}), so that no "
            f"tile straddles two scales."
        )
    if dot_fp32 is None:
        dot_fp32 = os.environ.get("TRITON_INTERPRET") == "1"
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y.view(*x.shape[:-1], n)
    # activations in groups of the weight's scale block along K (a whole row for per-channel
    # and per-tensor weights): one factor per row and K tile
    x_group = scale_k if scale_k < k else k
    if quantize_activations:
        operand, x_scales = quantize_fp8_groups(rows, x_group)
    else:
        operand, x_scales = rows, w_scales  # x_scales unread
    if block_m is None:
        block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _fp8_block_gemm[grid](
        operand,
        x_scales,
        weight,
        w_scales,
        bias if bias is not None else y,
        y,
        m,
        n,
        k,
        min(block[0], n),
        scale_k,
        x_group,
        operand.stride(0),
        x_scales.stride(0),
        weight.stride(0),
        w_scales.stride(0),
        y.stride(0),
        ACT_FP8=quantize_activations,
        HAS_BIAS=bias is not None,
        DOT_FP32=dot_fp32,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return y.view(*x.shape[:-1], n)
