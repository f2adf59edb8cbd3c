"""The routed experts' matmuls in Triton: one grouped GEMM over all of a layer's experts.

The (token, choice) pairs are sorted by expert and each expert's run padded to a multiple
of ``BLOCK_M`` rows, so that every row tile belongs to one expert; the kernel multiplies each
tile by its expert's weight, ``K`` in ``BLOCK_K`` steps (float32 accumulation). :func:`fused_moe`
runs the gate/up GEMM, the activation, the down GEMM and the weighted sum back to the tokens;
``engine.layers.moe.Experts`` (one matmul pair per expert in torch) is its reference.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _grouped_matmul(
    x,
    w,
    out,
    tile_expert,
    rows,
    n,
    k,
    stride_xm,
    stride_we,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[m] = x[m] @ w[expert of m's tile].T; x [rows, k], w [E, n, k], out [rows, n]."""
    tile = tl.program_id(0)
    column_tile = tl.program_id(1)
    expert = tl.load(tile_expert + tile)
    rm = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = column_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, k, BLOCK_K):
        rk = start + tl.arange(0, BLOCK_K)
        a = tl.load(
            x + rm[:, None] * stride_xm + rk[None, :], mask=(rm[:, None] < rows) & (rk[None, :] < k), other=0.0
        ).to(tl.float32)
        b = tl.load(
            w + expert * stride_we + rn[None, :] * stride_wn + rk[:, None],
            mask=(rn[None, :] < n) & (rk[:, None] < k),
            other=0.0,
        ).to(tl.float32)  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(a, b)
    tl.store(out + rm[:, None] * stride_om + rn[None, :], acc, mask=(rm[:, None] < rows) & (rn[None, :] < n))


def grouped_matmul(
    x: torch.Tensor, w: torch.Tensor, tile_expert: torch.Tensor, block_m: int, block_n: int = 32, block_k: int = 32
) -> torch.Tensor:
    """x [rows, k] (rows a multiple of ``block_m``, tile ``i`` of it all expert
    ``tile_expert[i]``'s), w [E, n, k] -> [rows, n] float32."""
    rows, k = x.shape
    n = w.shape[1]
    x, w = x.contiguous(), w.contiguous()
    out = torch.empty(rows, n, dtype=torch.float32, device=x.device)
    grid = (rows // block_m, triton.cdiv(n, block_n))
    _grouped_matmul[grid](
        x,
        w,
        out,
        tile_expert,
        rows,
        n,
        k,
        x.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return out


def sort_by_expert(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair of each padded row [rows] — the flat (token, choice) index, -1 for padding — and
    the expert of each row tile [rows / block_m]): the pairs grouped by expert, each group
    padded to a multiple of ``block_m``."""
    flat = expert_ids.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.zeros_like(padded)
    starts[1:] = padded.cumsum(0)[:-1]
    group_starts = torch.zeros_like(counts)
    group_starts[1:] = counts.cumsum(0)[:-1]
    pairs = torch.full((int(padded.sum()),), -1, dtype=torch.int64, device=expert_ids.device)
    sorted_experts = flat[order]
    rank = torch.arange(order.shape[0], device=order.device) - group_starts[sorted_experts]
    pairs[starts[sorted_experts] + rank] = order
    tile_expert = torch.repeat_interleave(torch.arange(num_experts, device=expert_ids.device), padded // block_m)
    return pairs, tile_expert


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    activation: Callable[[torch.Tensor], torch.Tensor] | None = None,
    block_m: int = 16,
) -> torch.Tensor:
    """Σ_k weights[t, k] · down(act(gate_up(x[t]))) of the chosen experts: x [T, hidden], w13
    [E, 2I, hidden] (gate rows then up rows), w2 [E, hidden, I], expert_ids / weights [T, k].
    ``activation`` maps [rows, 2I] -> [rows, I] (default SiLU-and-multiply). Returns [T, hidden]
    in x's dtype."""
    num_tokens, choices = expert_ids.shape
    pairs, tile_expert = sort_by_expert(expert_ids, w13.shape[0], block_m)
    valid = pairs >= 0
    token_of = pairs.clamp(min=0) // choices
    rows_in = x[token_of] * valid[:, None]  # padding rows: zeros
    gate_up = grouped_matmul(rows_in, w13, tile_expert, block_m)
    if activation is None:
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = F.silu(gate) * up
    else:
        hidden = activation(gate_up)
    down = grouped_matmul(hidden, w2, tile_expert, block_m)  # [rows, hidden]
    scale = weights.flatten().float()[pairs.clamp(min=0)] * valid
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, token_of, down * scale[:, None])
    return out.to(x.dtype)
