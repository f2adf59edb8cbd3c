"""DeepSeek-V4's KV compressor: pools every ``ratio`` tokens' projections into one
compressed entry, from per-token projections kept in a ``token_state`` cache until their
window completes (possibly steps later, under chunked prefill or decode)."""

from __future__ import annotations

import torch
from torch import nn

from engine.interfaces.forward_context import ForwardContext
from engine.layers.linear import Linear
from engine_deepseek_v4.deepseek_v4.config import V4Dims
from engine_deepseek_v4.deepseek_v4.norms import Fp32RMSNorm
from engine_deepseek_v4.deepseek_v4.rope import Rope, rotate


class Compressor(nn.Module):
    """Pools every ``ratio`` tokens' ``kv_proj`` rows into one entry of ``size`` dims, gated by a
    softmax over ``gate_proj`` + ``position_bias``. With ``overlap`` each token projects two
    series (``2 · size``): entry ``w`` pools window ``w - 1``'s first series with window ``w``'s
    second (none before window 0). The projections of every token are kept in token-state
    layer ``state_layer`` until their windows complete."""

    def __init__(
        self, dims: V4Dims, ratio: int, size: int, overlap: bool, state_layer: int, dtype: torch.dtype
    ) -> None:
        super().__init__()
        series = 2 if overlap else 1
        self.kv_proj = Linear(dims.hidden_size, series * size, False, dtype)
        self.gate_proj = Linear(dims.hidden_size, series * size, False, dtype)
        self.position_bias = nn.Parameter(torch.empty(ratio, series * size, dtype=torch.float32), requires_grad=False)
        self.kv_norm = Fp32RMSNorm(size, dims.rms_norm_eps)
        self.ratio, self.size, self.overlap, self.state_layer = ratio, size, overlap, state_layer

    def state_size(self) -> int:
        return 2 * self.position_bias.shape[1]  # kv then gate rows

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext, rope: Rope) -> torch.Tensor:
        """[T, size]: the entry of each new token that ends a window (zeros for the others)."""
        ratio, size = self.ratio, self.size
        kv, gate = self.kv_proj(x), self.gate_proj(x)
        ctx.store(self.state_layer, torch.cat([kv, gate], dim=-1))
        entries = x.new_zeros(x.shape[0], size)
        ends = ((positions + 1) % ratio == 0).nonzero().flatten()
        if ends.numel() == 0:
            return entries
        span = (2 if self.overlap else 1) * ratio
        window = positions[:, None] - span + 1 + torch.arange(span, device=x.device)  # [T, span]
        window = window.masked_fill((window < 0) | ((positions + 1) % ratio != 0)[:, None], -1)
        state = ctx.gather(self.state_layer, window)[ends]  # [n, span, 2 · series · size]
        kv_rows, gate_rows = state.split(state.shape[-1] // 2, dim=-1)
        bias = self.position_bias
        if self.overlap:
            first = window[ends, 0] >= 0  # window w - 1 exists
            previous_gate = (gate_rows[:, :ratio, :size].float() + bias[:, :size]).masked_fill(
                ~first[:, None, None], float("-inf")
            )
            previous_kv = kv_rows[:, :ratio, :size].masked_fill(~first[:, None, None], 0)
            kv_rows = torch.cat([previous_kv, kv_rows[:, ratio:, size:]], dim=1)  # [n, 2 · ratio, size]
            gate_rows = torch.cat([previous_gate, gate_rows[:, ratio:, size:].float() + bias[:, size:]], dim=1)
        else:
            gate_rows = gate_rows.float() + bias
        pooled = (kv_rows * gate_rows.softmax(dim=1).to(kv_rows.dtype)).sum(dim=1)
        cos, sin = rope.cos_sin(positions[ends] + 1 - ratio)  # the window's first position
        entries[ends] = rotate(self.kv_norm(pooled), cos, sin)
        return entries
