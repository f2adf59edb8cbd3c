"""Group-quantized linear layers in Triton: ``y = x Wᵀ + b`` read straight from the packed
weight of ``engine.interfaces.group_quant`` (4-bit nibbles, 6-bit nibbles and top bits, or
bytes; a float32 scale and offset per output row and group of inputs, or int8 codes times a
float32 per super-block of groups).

One program per [BLOCK_M rows of x, BLOCK_N outputs] tile of ``y`` walks K ``BLOCK_K`` inputs
at a time, a K tile never straddling two groups (``BLOCK_K`` divides ``group_size``). The
tile's integers are unpacked in registers and the group's scale and offset applied to the
tile's sums rather than to the weight:

    Σ_k x[m, k] (s[n] q[n, k] - o[n]) = s[n] · Σ_k x[m, k] q[n, k]  -  o[n] · Σ_k x[m, k]

``tl.dot`` multiplies ``x`` in its own dtype by ``q`` converted to it (every integer below
256 is exact in bfloat16 and float16), so each product is exact and summed in float32: the
result is the reference's (:func:`engine.interfaces.group_quant.group_quant_linear`) up to the
float32 rounding of the sums, as ``LayerOps.group_quant_linear`` asks. Float32 ``x`` (and
everything under the Triton interpreter, ``TRITON_INTERPRET=1``, whose ``tl.dot`` on 16-bit
operands is not exact) takes the float32 dot with IEEE precision.

Decode (at most ``SPLIT_K_MAX_ROWS`` rows) has few output tiles to spread over a GPU's
cores, so K is split among up to ``split`` programs per tile (split-K), each writing its
float32 partial sums, added afterwards in a fixed order.

Imports Triton: loaded only where a GPU platform's layer ops run it (:class:`TritonLayerOps`).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from engine.interfaces.group_quant import GroupQuantWeight
from engine.interfaces.ops import LayerOps

MIN_BLOCK_K = 16  # the smallest K tile tl.dot takes
MAX_BLOCK_K = 64
SPLIT_K_MAX_ROWS = 16  # decode: rows up to this split K among programs
SPLIT_K_PROGRAMS = 256  # programs a split-K launch aims for (a few per core of today's GPUs)


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``), on the CPU."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _group_quant_matmul(
    x,
    qweight,
    scales,
    offsets,
    super_scales,
    super_offsets,
    bias,
    y,
    M,
    N,
    K,
    tiles_per_split,
    stride_xm,
    stride_qn,
    stride_sn,
    stride_on,
    stride_ssn,
    stride_son,
    stride_ys,
    stride_ym,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    SUPER_GROUP: tl.constexpr,
    ZERO: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """x [M, K] (bf16 / fp16 / fp32); qweight [N, K * BITS / 8] uint8; scales, offsets
    [N, K / GROUP_SIZE] float32 (``SUPER_GROUP`` 0) or int8 codes times ``super_scales``,
    ``super_offsets`` [N, K / GROUP_SIZE / SUPER_GROUP] float32 (``ZERO`` >= 0: no offsets, each
    the zero times its scale); bias [N]; y [splits, M, N]: split
    ``program_id(2)``'s sums over its ``tiles_per_split`` K tiles (plus the bias, in y's dtype,
    when there is one split)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    first_tile = pid_k * tiles_per_split
    last_tile = tl.minimum(first_tile + tiles_per_split, K // BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for tile in range(first_tile, last_tile):
        k0 = tile * BLOCK_K
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask_m[:, None], other=0.0)
        if BITS != 8:
            # byte j holds input 2j in its low nibble, 2j + 1 in its high one
            offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            packed = tl.load(qweight + offs_n[:, None] * stride_qn + offs_b[None, :], mask=mask_n[:, None], other=0)
            q = tl.interleave(packed & 0xF, packed >> 4)  # [BLOCK_N, BLOCK_K]
            if BITS == 6:
                # the top 2 bits of input k: 32 bytes per chunk of 128 inputs; input k is lane
                # (k % 128) // 2 of its chunk's even or odd inputs, in byte lane % 32 at bit
                # 2 (lane // 32) (even) or 2 (lane // 32) + 4 (odd)
                lane = (offs_k % 128) // 2
                byte = K // 2 + (offs_k // 128) * 32 + lane % 32
                top = tl.load(qweight + offs_n[:, None] * stride_qn + byte[None, :], mask=mask_n[:, None], other=0)
                shift = 2 * (lane // 32) + 4 * (offs_k % 2)
                q = q | (((top >> shift[None, :].to(tl.uint8)) & 0x3) << 4)
        else:
            q = tl.load(qweight + offs_n[:, None] * stride_qn + offs_k[None, :], mask=mask_n[:, None], other=0)
        if DOT_FP32:
            a32 = a.to(tl.float32)
            part = tl.dot(a32, tl.trans(q.to(tl.float32)), input_precision="ieee")
            x_sum = tl.sum(a32, axis=1)
        else:
            part = tl.dot(a, tl.trans(q.to(a.dtype)))  # exact products, float32 sums
            x_sum = tl.sum(a.to(tl.float32), axis=1)
        group = k0 // GROUP_SIZE
        scale = tl.load(scales + offs_n * stride_sn + group, mask=mask_n, other=0).to(tl.float32)
        if SUPER_GROUP > 0:
            scale *= tl.load(super_scales + offs_n * stride_ssn + group // SUPER_GROUP, mask=mask_n, other=0.0)
        if ZERO >= 0:  # symmetric: each offset is the zero times the scale
            offset = scale * ZERO
        else:
            offset = tl.load(offsets + offs_n * stride_on + group, mask=mask_n, other=0).to(tl.float32)
            if SUPER_GROUP > 0:
                offset *= tl.load(super_offsets + offs_n * stride_son + group // SUPER_GROUP, mask=mask_n, other=0.0)
        acc += part * scale[None, :] - x_sum[:, None] * offset[None, :]
    if HAS_BIAS:
        acc += tl.load(bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out = y + pid_k * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(out, acc.to(y.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def block_k_for(group_size: int, limit: int = MAX_BLOCK_K) -> int | None:
    """The K tile for ``group_size``: the largest power of two up to ``limit`` that divides it
    (so that no tile straddles two groups); None below ``MIN_BLOCK_K`` (no kernel for that group size)."""
    block = limit
    while block >= MIN_BLOCK_K:
        if group_size % block == 0:
            return block
        block //= 2
    return None


def supports(weight: GroupQuantWeight) -> bool:
    """Whether the kernel takes ``weight``: its group size a multiple of ``MIN_BLOCK_K``."""
    return block_k_for(weight.group_size) is not None


def split_count(rows: int, column_tiles: int, k_tiles: int) -> int:
    """K splits for a launch of ``column_tiles`` output tiles: 1 above ``SPLIT_K_MAX_ROWS``
    rows, else enough for ``SPLIT_K_PROGRAMS`` programs (at most one a K tile)."""
    if rows > SPLIT_K_MAX_ROWS:
        return 1
    return max(1, min(k_tiles, SPLIT_K_PROGRAMS // column_tiles))


def triton_group_quant_linear(
    x: torch.Tensor,
    weight: GroupQuantWeight,
    bias: torch.Tensor | None = None,
    *,
    split: int | None = None,
    block_n: int = 64,
    block_k: int | None = None,
    dot_fp32: bool | None = None,
) -> torch.Tensor:
    """x [..., K] (bf16 / fp16 / fp32) times the dequantized ``weight``, transposed, plus
    ``bias`` [N]: [..., N] in x's dtype; the inputs are put in the weight's order first.

    ``split``: programs sharing each output tile's K (default :func:`split_count`);
    ``block_k``: the K tile (default :func:`block_k_for` the group size); ``dot_fp32``: float32
    dot operands (default: under the interpreter, or for float32 ``x``)."""
    k, n = weight.in_features, weight.out_features
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} inputs; the group-quantized weight takes {k}.")
    if block_k is None:
        block_k = block_k_for(weight.group_size)
    if block_k is None or block_k < MIN_BLOCK_K or weight.group_size % block_k:
        raise ValueError(
            f"group size {weight.group_size} has no K tile of {MIN_BLOCK_K} or more inputs that divides it "
            f"(asked for {block_k}); run the torch reference engine.interfaces.group_quant.group_quant_linear."
        )
    if dot_fp32 is None:
        dot_fp32 = interpreting() or x.dtype == torch.float32
    rows = weight.order_inputs(x).reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    out_shape = (*x.shape[:-1], n)
    if m == 0:
        return torch.empty(out_shape, dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    column_tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    k_tiles = k // block_k
    if split is None:
        split = split_count(m, column_tiles, k_tiles)
    tiles_per_split = triton.cdiv(k_tiles, max(1, min(split, k_tiles)))
    split = triton.cdiv(k_tiles, tiles_per_split)
    # the kernel rounds to x's dtype only when it writes the whole sums: the interpreter's
    # float32 -> bfloat16 conversion truncates, torch's rounds to nearest
    in_kernel = split == 1 and not interpreting()
    y = torch.empty(split, m, n, dtype=x.dtype if in_kernel else torch.float32, device=x.device)
    qweight, scales = (t if t.stride(-1) == 1 else t.contiguous() for t in (weight.qweight, weight.scales))
    symmetric = weight.zero is not None
    offsets = scales if symmetric else weight.offsets.contiguous()  # unread with a zero
    two_level = weight.super_group > 0
    super_scales = weight.super_scales.contiguous() if two_level else scales  # unread with one level
    super_offsets = weight.super_offsets.contiguous() if two_level and not symmetric else offsets
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split)
    _group_quant_matmul[grid](
        rows,
        qweight,
        scales,
        offsets,
        super_scales,
        super_offsets,
        bias.contiguous() if bias is not None else qweight,  # unread without a bias
        y,
        m,
        n,
        k,
        tiles_per_split,
        rows.stride(0),
        qweight.stride(0),
        scales.stride(0),
        offsets.stride(0),
        super_scales.stride(0),
        super_offsets.stride(0),
        y.stride(0),
        y.stride(1),
        BITS=weight.bits,
        GROUP_SIZE=weight.group_size,
        SUPER_GROUP=weight.super_group,
        ZERO=-1 if weight.zero is None else weight.zero,
        HAS_BIAS=bias is not None and split == 1,
        DOT_FP32=dot_fp32,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    if in_kernel:
        return y.view(out_shape)
    sums = y[0] if split == 1 else y.sum(dim=0)
    if bias is not None and split > 1:
        sums += bias.float()
    return sums.to(x.dtype).view(out_shape)


class TritonLayerOps(LayerOps):
    """The reference layer ops, with group-quantized linear layers through
    :func:`triton_group_quant_linear` (GPU platforms' ``layer_ops``). Weights whose group
    size the kernel does not take, and CPU tensors outside the interpreter, go to the reference."""

    def group_quant_linear(
        self, x: torch.Tensor, weight: GroupQuantWeight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if not supports(weight) or (x.device.type == "cpu" and not interpreting()):
            return super().group_quant_linear(x, weight, bias)
        return triton_group_quant_linear(x, weight, bias)
