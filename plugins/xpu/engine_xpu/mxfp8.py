"""MXFP8, the OCP Microscaling format with ``float8_e4m3fn`` elements, in torch.

A weight [out, in] is held as

- ``elements``: float8_e4m3fn [out, in];
- ``scales``: uint8 [out, ceil(in / 32)], one E8M0 biased exponent ``s`` per 32
  consecutive elements of a row (the last block of a row may be shorter); the
  block's factor is ``2^(s - 127)`` (``s = 255`` is NaN). ``float8_e8m0fnu``
  tensors hold the same bytes and are accepted wherever scales are.

The weight is each element times its block's factor. Quantizing picks for every
block the smallest power of two ``2^e`` with ``amax <= 448 · 2^e`` (448 is e4m3's
largest value), so nothing is clipped and the block's largest element lands in
(224, 448]; elements then round to nearest even. A block of zeros gets the smallest
factor, ``2^-127``; a block holding inf or NaN gets the NaN scale.

A dequantized element is an e4m3 value (4 significant bits) times a power of two:
it is exact in float32 and, within their exponent range, in bfloat16 and float16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 32  # elements sharing one scale
E4M3_MAX = 448.0
E8M0_BIAS = 127
E8M0_NAN = 255
MIN_EXPONENT, MAX_EXPONENT = -127, 127  # what E8M0 encodes besides NaN


def num_blocks(columns: int) -> int:
    """Scales a row of ``columns`` elements needs."""
    return -(-columns // BLOCK)


def exp2_exact(exponent: torch.Tensor) -> torch.Tensor:
    """``2^e`` in float32 for integer ``e`` in [-127, 127], built from its bits (so exact;
    ``2^-127`` is a subnormal)."""
    exponent = exponent.to(torch.int32)
    bits = torch.where(exponent > MIN_EXPONENT, (exponent + 127) << 23, torch.full_like(exponent, 1 << 22))
    return bits.view(torch.float32)


def e8m0_bytes(scales: torch.Tensor) -> torch.Tensor:
    """The uint8 biased exponents of ``scales`` (uint8, or float8_e8m0fnu viewed as bytes)."""
    if scales.dtype == torch.uint8:
        return scales
    if scales.dtype == getattr(torch, "float8_e8m0fnu", None):
        return scales.view(torch.uint8)
    raise TypeError(f"MXFP8 scales must be uint8 or float8_e8m0fnu biased exponents, got {scales.dtype}.")


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """The float32 factor ``2^(s - 127)`` of each scale (NaN for ``s = 255``)."""
    codes = e8m0_bytes(scales).to(torch.int32)
    factors = exp2_exact(codes.clamp(max=254) - E8M0_BIAS)
    return torch.where(codes == E8M0_NAN, torch.full_like(factors, float("nan")), factors)


def mxfp8_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] (any float dtype) -> (elements float8_e4m3fn [out, in],
    scales uint8 [out, ceil(in / 32)]), on ``weight``'s device."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(
            f"mxfp8_quantize takes a 2-d float weight [out, in], got {tuple(weight.shape)} {weight.dtype}."
        )
    rows, columns = weight.shape
    blocks = num_blocks(columns)
    values = F.pad(weight.float(), (0, blocks * BLOCK - columns)).view(rows, blocks, BLOCK)
    amax = values.abs().amax(dim=-1)  # [out, blocks]
    finite = torch.isfinite(amax)
    # estimate e = ceil(log2(amax / 448)), then correct it by exact comparisons against 448 · 2^e
    estimate = torch.ceil(torch.log2(amax / E4M3_MAX))
    exponent = torch.where(finite, estimate, 0.0).clamp(MIN_EXPONENT, MAX_EXPONENT).to(torch.int32)
    exponent = torch.where(amax > E4M3_MAX * exp2_exact(exponent), exponent + 1, exponent)
    lower = (exponent - 1).clamp(min=MIN_EXPONENT)
    exponent = torch.where(amax <= E4M3_MAX * exp2_exact(lower), lower, exponent).clamp(MIN_EXPONENT, MAX_EXPONENT)
    scaled = values * exp2_exact(-exponent)[..., None]  # |scaled| <= 448, a power of two away: exact
    elements = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(rows, blocks * BLOCK)[:, :columns]
    scales = torch.where(finite, exponent + E8M0_BIAS, E8M0_NAN).to(torch.uint8)
    return elements.contiguous(), scales


def mxfp8_dequantize(elements: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """elements float8_e4m3fn [out, in], scales [out, ceil(in / 32)] -> the weight [out, in] in ``dtype``."""
    check_mxfp8(elements, scales)
    columns = elements.shape[1]
    factors = e8m0_to_float(scales).repeat_interleave(BLOCK, dim=1)[:, :columns]
    return (elements.float() * factors).to(dtype)


def mxfp8_linear_reference(
    x: torch.Tensor, elements: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., in] -> x · dequant(W)ᵀ + bias [..., out] in x's dtype, by dequantizing the
    weight to x's dtype (exactly) and ``F.linear``."""
    return F.linear(x, mxfp8_dequantize(elements, scales, x.dtype), bias)


def check_mxfp8(elements: torch.Tensor, scales: torch.Tensor) -> None:
    """Raise ``ValueError`` / ``TypeError`` unless the pair is an MXFP8 weight."""
    if elements.dtype != torch.float8_e4m3fn or elements.dim() != 2:
        raise TypeError(
            f"MXFP8 elements must be a 2-d float8_e4m3fn tensor, got {tuple(elements.shape)} {elements.dtype}."
        )
    e8m0_bytes(scales)
    expected = (elements.shape[0], num_blocks(elements.shape[1]))
    if tuple(scales.shape) != expected:
        raise ValueError(
            f"MXFP8 elements of shape {tuple(elements.shape)} need scales of shape {expected} (one per "
            f"{BLOCK} elements of a row), got {tuple(scales.shape)}."
        )
