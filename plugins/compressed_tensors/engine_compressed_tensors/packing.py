"""The ``pack-quantized`` tensor layout of compressed-tensors, and round-to-nearest quantization
of a dense weight into it.

For a linear module with weight W [N, K] (N outputs, K inputs), ``bits`` 4 or 8 and groups of
``g`` inputs (``strategy: channel``: g = K, one group a row):

- the integers are signed, ``q`` in ``[-2**(bits-1), 2**(bits-1))``, and stored offset by
  ``2**(bits-1)`` (``u = q + 2**(bits-1)``, in ``[0, 2**bits)``);
- ``weight_packed`` int32 [N, ceil(K / p)], ``p = 32 / bits`` values a word along the inputs:
  bits ``[bits * i, bits * (i + 1))`` of word ``j`` hold ``u[n, p * j + i]`` (element 0 in the
  low bits; the last word zero-padded);
- ``weight_scale`` [N, K / g] (the model's float dtype);
- ``weight_zero_point`` (asymmetric only): the zero points ``z`` (signed, as ``q``), packed the
  same way along the outputs, int32 [ceil(N / p), K / g]; earlier versions of the library
  stored them unpacked, [N, K / g];
- ``weight_shape`` int [2]: (N, K);

and W[n, k] = weight_scale[n, k // g] * (q[n, k] - z[n, k // g]) (z = 0 when symmetric).
"""

from __future__ import annotations

import torch

PACKED_BITS = (4, 8)


def pack_factor(bits: int) -> int:
    return 32 // bits


def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, 32, bits, dtype=torch.int32, device=device)


def unpack(packed: torch.Tensor, bits: int, size: int, dim: int = 1) -> torch.Tensor:
    """int32 words -> the stored (offset, unsigned) values as int32, ``size`` of them along
    ``dim`` (the padding of the last word dropped)."""
    words = packed if dim == 1 else packed.t()
    values = (words.unsqueeze(-1) >> _shifts(bits, words.device)) & ((1 << bits) - 1)  # [R, C, p]
    values = values.reshape(words.shape[0], -1)[:, :size]
    return values if dim == 1 else values.t()


def pack(values: torch.Tensor, bits: int, dim: int = 1) -> torch.Tensor:
    """Stored values in ``[0, 2**bits)`` -> int32 words along ``dim`` (the inverse of :func:`unpack`)."""
    rows = values.to(torch.int64) if dim == 1 else values.to(torch.int64).t()
    per_word = pack_factor(bits)
    padding = -rows.shape[1] % per_word
    rows = torch.nn.functional.pad(rows, (0, padding))
    grouped = rows.reshape(rows.shape[0], -1, per_word)  # [R, C, p]
    words = (grouped << _shifts(bits, rows.device).to(torch.int64)).sum(dim=-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return (words if dim == 1 else words.t()).contiguous()


def quantize_rtn(
    weight: torch.Tensor, bits: int, group_size: int, symmetric: bool, scale_dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Round-to-nearest ``pack-quantized`` tensors of a dense ``weight`` [N, K] with the
    library's min/max rule per group of ``group_size`` inputs (the range always holding 0):
    symmetric: scale = max |w| / ((2**bits - 1) / 2), zero 0; else scale = (max - min) /
    (2**bits - 1), zero = -2**(bits-1) - round(min / scale). The scales are rounded to
    ``scale_dtype`` before the weights are rounded with them."""
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise ValueError(f"groups of {group_size} inputs do not divide the {in_features} inputs of this weight.")
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    w = weight.detach().float().reshape(out_features, in_features // group_size, group_size)  # [N, G, g]
    lo, hi = w.amin(dim=-1).clamp(max=0), w.amax(dim=-1).clamp(min=0)
    if symmetric:
        scales = torch.maximum(-lo, hi) / ((high - low) / 2)
    else:
        scales = (hi - lo) / (high - low)
    scales = torch.where(scales == 0, torch.ones_like(scales), scales).to(scale_dtype)
    if symmetric:
        zeros = torch.zeros_like(scales, dtype=torch.float32)
    else:
        zeros = (low - torch.round(lo / scales.float())).clamp(low, high)
    q = (torch.round(w / scales.float().unsqueeze(-1)) + zeros.unsqueeze(-1)).clamp(low, high)
    offset = 1 << (bits - 1)
    tensors = {
        "weight_packed": pack((q.reshape(out_features, in_features) + offset).to(torch.int64), bits),
        "weight_scale": scales.contiguous(),
        "weight_shape": torch.tensor([out_features, in_features], dtype=torch.int64),
    }
    if not symmetric:
        tensors["weight_zero_point"] = pack((zeros + offset).to(torch.int64), bits, dim=0)
    return tensors
