"""The AWQ GEMM tensor layout (AutoAWQ's ``version: gemm``): 4-bit integers packed eight to an
int32 word along the outputs in an interleaved order, and round-to-nearest quantization of a
dense weight into it.

For a linear module with weight W [N, K] (N outputs, K inputs) and groups of ``g`` inputs:

- ``qweight`` int32 [K, N / 8]: the 4 bits at ``4 * i`` of ``qweight[k, j]`` hold
  q[k, 8 j + AWQ_ORDER[i]], AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7) (the even outputs of the
  eight in the low half of the word, the odd ones in the high half);
- ``qzeros`` int32 [K / g, N / 8]: z[k // g, n], packed the same way (stored as is);
- ``scales`` float16 [K / g, N];

and W[n, k] = (q[k, n] - z[k // g, n]) * scales[k // g, n].
"""

from __future__ import annotations

import torch

BITS = 4
PACK = 32 // BITS  # values a word
# nibble i of a word holds output AWQ_ORDER[i] of its eight
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _shifts(device: torch.device) -> torch.Tensor:
    return torch.arange(0, 32, BITS, dtype=torch.int32, device=device)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """[R, C] int32 words -> [R, 8 C] int32 values in output order (``qweight``, ``qzeros``)."""
    nibbles = (packed.unsqueeze(-1) >> _shifts(packed.device)) & 0xF  # [R, C, 8]: nibble i
    order = torch.tensor(AWQ_ORDER, device=packed.device)
    values = torch.empty_like(nibbles)
    values[..., order] = nibbles  # output AWQ_ORDER[i] <- nibble i
    return values.reshape(packed.shape[0], -1)


def pack(values: torch.Tensor) -> torch.Tensor:
    """[R, N] integers in [0, 16) -> [R, N / 8] int32 words (the inverse of :func:`unpack`)."""
    grouped = values.to(torch.int64).reshape(values.shape[0], -1, PACK)  # [R, N / 8, 8] by output
    nibbles = grouped[..., list(AWQ_ORDER)]  # nibble i <- output AWQ_ORDER[i]
    words = (nibbles << _shifts(values.device).to(torch.int64)).sum(dim=-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def quantize_rtn(weight: torch.Tensor, group_size: int, zero_point: bool) -> dict[str, torch.Tensor]:
    """Round-to-nearest AWQ tensors (``qweight``, ``qzeros``, ``scales``) of a dense ``weight``
    [N, K], with AutoAWQ's min/max rule per group of inputs (without its activation-aware
    scaling search, which needs calibration data): ``zero_point``: scale = (max - min) / 15,
    zero = -round(min / scale); else scale = max |w| / 7 and zero 8 (q - 8 in [-8, 7]). The
    scales are rounded to float16 before the weights are rounded with them."""
    out_features, in_features = weight.shape
    size = in_features if group_size == -1 else group_size
    if in_features % size or out_features % PACK:
        raise ValueError(
            f"An AWQ layer of {out_features} outputs and {in_features} inputs cannot be packed: the outputs must "
            f"be a multiple of {PACK} and the groups of {size} inputs must divide the inputs."
        )
    w = weight.detach().float().reshape(out_features, in_features // size, size)  # [N, G, g]
    if zero_point:
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)
        scales = ((hi - lo).clamp(min=1e-5) / 15).half()
        zeros = (-torch.round(lo / scales.float())).clamp(0, 15)
    else:
        scales = (w.abs().amax(dim=-1).clamp(min=1e-5) / 7).half()
        zeros = torch.full_like(scales, 8, dtype=torch.float32)
    q = (torch.round(w / scales.float().unsqueeze(-1)) + zeros.unsqueeze(-1)).clamp(0, 15)
    q = q.reshape(out_features, in_features).t().to(torch.int32)  # [K, N]
    return {
        "qweight": pack(q),
        "qzeros": pack(zeros.t().to(torch.int32)),  # [G, N / 8]
        "scales": scales.t().contiguous(),  # [G, N]
    }
