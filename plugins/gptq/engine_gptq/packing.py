"""The GPTQ tensor layout: packing integers into int32 words, and round-to-nearest
quantization of a dense weight into it.

For a linear module with weight W [N, K] (N outputs, K inputs), ``bits`` b and
``pack = 32 // b`` values to an int32 word:

- ``qweight`` int32 [K / pack, N]: q[k, n] sits in ``qweight[k // pack, n]`` at bits
  ``b * (k % pack)`` (packed along the input dim);
- ``qzeros`` int32 [G, N / pack]: z[g, n] sits in ``qzeros[g, n // pack]`` at bits
  ``b * (n % pack)`` (packed along the output dim); the classic format (``gptq``, v1)
  stores z - 1, ``gptq_v2`` stores z;
- ``scales`` float16 [G, N];
- ``g_idx`` int32 [K]: the group of each input row (``k // group_size`` in order, any
  permutation of groups with act-order);

and W[n, k] = scales[g_idx[k], n] * (q[k, n] - z[g_idx[k], n]).
"""

from __future__ import annotations

import torch


def values_per_word(bits: int) -> int:
    return 32 // bits


def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, 32, bits, dtype=torch.int32, device=device)


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, N] int32 words -> [R * pack, N] int32 values (packed along dim 0, as ``qweight``)."""
    mask = (1 << bits) - 1
    values = (packed.unsqueeze(1) >> _shifts(bits, packed.device).view(1, -1, 1)) & mask  # [R, pack, N]
    return values.reshape(-1, packed.shape[1])


def unpack_columns(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """[G, C] int32 words -> [G, C * pack] int32 values (packed along dim 1, as ``qzeros``)."""
    mask = (1 << bits) - 1
    values = (packed.unsqueeze(-1) >> _shifts(bits, packed.device)) & mask  # [G, C, pack]
    return values.reshape(packed.shape[0], -1)


def _to_int32_words(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words held in int64 -> the int32 tensor of the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[K, N] integers in [0, 2**bits) -> [K / pack, N] int32 words (the inverse of :func:`unpack_rows`)."""
    pack = values_per_word(bits)
    grouped = values.to(torch.int64).reshape(-1, pack, values.shape[1])  # [K / pack, pack, N]
    words = (grouped << _shifts(bits, values.device).to(torch.int64).view(1, -1, 1)).sum(dim=1)
    return _to_int32_words(words)


def pack_columns(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[G, N] integers in [0, 2**bits) -> [G, N / pack] int32 words (the inverse of :func:`unpack_columns`)."""
    pack = values_per_word(bits)
    grouped = values.to(torch.int64).reshape(values.shape[0], -1, pack)  # [G, N / pack, pack]
    words = (grouped << _shifts(bits, values.device).to(torch.int64)).sum(dim=-1)
    return _to_int32_words(words)


def quantize_rtn(
    weight: torch.Tensor, bits: int, group_size: int, sym: bool, act_order: bool, zeros_minus_one: bool
) -> dict[str, torch.Tensor]:
    """Round-to-nearest GPTQ tensors (``qweight``, ``qzeros``, ``scales``, ``g_idx``) of a
    dense ``weight`` [N, K], with the min/max rule of GPTQ's own quantizer per group (the
    range always holds 0; symmetric: zero at 2**(bits-1)). ``act_order`` groups the input
    rows in decreasing order of their weight norm, the permutation act-order checkpoints
    carry in ``g_idx`` (GPTQ orders them by activation statistics, which a weight alone
    does not have). ``zeros_minus_one``: the classic format, which cannot store a zero of
    0, so such zeros become 1."""
    out_features, in_features = weight.shape
    pack = values_per_word(bits)
    if in_features % pack or out_features % pack:
        raise ValueError(
            f"A {bits}-bit GPTQ layer packs {pack} values a word: its {out_features} outputs and "
            f"{in_features} inputs must both be multiples of {pack}."
        )
    maxq = (1 << bits) - 1
    size = in_features if group_size == -1 else group_size
    groups = -(-in_features // size)
    w = weight.detach().float().t()  # [K, N]
    if act_order:
        order = torch.argsort(w.norm(dim=1), descending=True, stable=True)
    else:
        order = torch.arange(in_features, device=w.device)
    g_idx = torch.empty(in_features, dtype=torch.int32, device=w.device)
    g_idx[order] = (torch.arange(in_features, device=w.device) // size).to(torch.int32)
    padded = w.new_zeros(groups * size, out_features)
    padded[:in_features] = w[order]
    grouped = padded.view(groups, size, out_features)
    xmin = grouped.amin(dim=1).clamp(max=0)  # [G, N]
    xmax = grouped.amax(dim=1).clamp(min=0)
    if sym:
        xmax = torch.maximum(xmin.abs(), xmax)
        xmin = torch.where(xmin < 0, -xmax, xmin)
    empty = (xmin == 0) & (xmax == 0)
    xmin, xmax = torch.where(empty, -1.0, xmin), torch.where(empty, 1.0, xmax)
    scales = ((xmax - xmin) / maxq).half()
    if sym:
        zeros = torch.full_like(xmin, (maxq + 1) // 2)
    else:
        zeros = torch.round(-xmin / scales.float()).clamp(0, maxq)
    if zeros_minus_one:
        zeros = zeros.clamp(min=1)
    zeros = zeros.to(torch.int32)
    q = torch.round(w / scales.float()[g_idx]) + zeros[g_idx]  # [K, N]
    q = q.clamp(0, maxq).to(torch.int32)
    return {
        "qweight": pack_rows(q, bits),
        "qzeros": pack_columns(zeros - 1 if zeros_minus_one else zeros, bits),
        "scales": scales,
        "g_idx": g_idx,
    }
