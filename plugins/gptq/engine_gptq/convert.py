"""GPTQ tensors into the engine's group-quantized layout (:mod:`engine.interfaces.group_quant`).

GPTQ's W[n, k] = scales[g_idx[k], n] * (q[k, n] - zero[g_idx[k], n]) becomes
``scale * q - offset`` with ``offset = scale * zero`` (exact in float32: a float16 or
bfloat16 scale times an integer of at most 9 bits). The layout's groups are runs of
consecutive inputs, so the inputs are gathered in the stable order of their ``g_idx``
(``input_order``, none when that order is the identity); every group then has to hold the
same number of inputs, or a number that one even size divides, each run of that size taking
its group's scale and offset.
"""

from __future__ import annotations

import math

import torch

from engine.interfaces.group_quant import GroupQuantWeight
from engine_gptq.packing import unpack_columns, unpack_rows


def group_run_size(counts: list[int], what: str) -> int:
    """The input count of the layout's groups: the greatest common divisor of the GPTQ groups'
    sizes (those that hold any input), which must be even."""
    size = math.gcd(*[c for c in counts if c]) if any(counts) else 0
    if size == 0 or size % 2:
        sizes = sorted({c for c in counts if c})
        raise ValueError(
            f"{what}: its g_idx gives groups of {', '.join(map(str, sizes))} inputs, which no even group size "
            f"divides; engine-gptq computes groups that an even number of inputs make up. Requantize with a "
            f"group_size that divides the inputs."
        )
    return size


def to_group_quant(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    bits: int,
    zeros_minus_one: bool,
    what: str = "A GPTQ layer",
) -> GroupQuantWeight:
    """One GroupQuantWeight from a module's (or several modules' joined along N, when they share
    one ``g_idx``) GPTQ tensors: ``qweight`` [K / pack, N], ``qzeros`` [G, N / pack], ``scales``
    [G, N], ``g_idx`` [K]. ``zeros_minus_one``: the classic format, which stores zero - 1."""
    q = unpack_rows(qweight, bits)  # [K, N]
    zeros = unpack_columns(qzeros, bits)  # [G, N]
    if zeros_minus_one:
        zeros = zeros + 1
    groups = scales.shape[0]
    g_idx = g_idx.to(torch.int64)
    counts = torch.bincount(g_idx, minlength=groups)  # [G] inputs per group
    size = group_run_size(counts.tolist(), what)
    order = torch.sort(g_idx, stable=True).indices  # inputs of group 0, then group 1, ...
    # the GPTQ group of each run of `size` inputs in that order
    run_groups = torch.repeat_interleave(torch.arange(groups, device=counts.device), counts // size)
    run_scales = scales.float()[run_groups].t()  # [N, K / size]
    run_offsets = run_scales * zeros[run_groups].t().float()
    identity = torch.equal(order, torch.arange(order.numel(), device=order.device))
    return GroupQuantWeight.from_values(
        q[order].t(),  # [N, K] in the gathered order
        run_scales,
        run_offsets,
        bits,
        input_order=None if identity else order,
    )
