"""DeepSeek-V4's experts: the router (hash-routed by ``tid2eid`` in ``hash_moe`` layers,
by ``scoring_func`` scores plus ``e_score_correction_bias`` elsewhere), the shared expert
and the block of both, every expert with the ``swiglu_limit``-clamped SwiGLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import TensorParallel
from engine.interfaces.forward_context import ForwardContext
from engine.layers.linear import Linear, MergedLinear
from engine.layers.moe import Experts, clamped_swiglu
from engine_deepseek_v4.deepseek_v4.config import SCORE_FUNCTIONS, V4Dims


class V4Router(nn.Module):
    """Scores ``scoring_func(x · Wᵀ)``; experts by top-k of score + ``e_score_correction_bias``,
    or (hash layers) by ``tid2eid[token]``; weights the chosen scores normalised, times
    ``routed_scaling_factor``."""

    def __init__(self, dims: V4Dims, hashed: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dims.num_experts, dims.hidden_size), requires_grad=False)
        if hashed:
            self.tid2eid = nn.Parameter(
                torch.zeros(dims.vocab_size, dims.experts_per_token, dtype=torch.int64), requires_grad=False
            )
        else:
            self.e_score_correction_bias = nn.Parameter(torch.empty(dims.num_experts), requires_grad=False)
        self.dims, self.hashed = dims, hashed

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.dims
        scores = SCORE_FUNCTIONS[d.scoring_func](F.linear(x.float(), self.weight.float()))  # [T, E]
        if self.hashed:
            chosen = self.tid2eid[input_ids]
        else:
            chosen = (scores + self.e_score_correction_bias.float()).topk(d.experts_per_token, dim=-1, sorted=False)[1]
        weights = scores.gather(1, chosen)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return chosen, weights * d.routed_scaling_factor


class ClampedMLP(nn.Module):
    """The shared expert: ``down(silu(min(gate, limit)) · clamp(up, ±limit))``."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, limit: float, dtype: torch.dtype, *, tp: TensorParallel
    ) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size] * 2, False, dtype, tp=tp)
        self.down_proj = Linear(intermediate_size, hidden_size, False, dtype)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clamped_swiglu(self.gate_up_proj(x), self.limit))


class V4MoE(nn.Module):
    def __init__(self, dims: V4Dims, hashed: bool, dtype: torch.dtype, *, tp: TensorParallel) -> None:
        super().__init__()
        self.gate = V4Router(dims, hashed)
        self.experts = Experts(
            dims.num_experts, dims.moe_intermediate_size, dims.hidden_size, dtype, swiglu_limit=dims.swiglu_limit, tp=tp
        )
        self.shared_experts = ClampedMLP(dims.hidden_size, dims.moe_intermediate_size, dims.swiglu_limit, dtype, tp=tp)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        expert_ids, weights = self.gate(x, input_ids)
        return self.experts(x, expert_ids, weights, ctx) + self.shared_experts(x)
