"""DeepSeek-V4's attention: one shared key=value head over a sliding window, plus in
compressed layers the compressed entries (all finished ones, or the lightning indexer's
pick), the parts merged with per-head sinks into one softmax, and the grouped low-rank
output projection. ``CacheLayers`` names the KV-cache layers one attention uses."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.interfaces.forward_context import ForwardContext
from engine.layers.linear import Linear
from engine_deepseek_v4.deepseek_v4.compressor import Compressor
from engine_deepseek_v4.deepseek_v4.config import CSA, SLIDING, V4Dims
from engine_deepseek_v4.deepseek_v4.indexer import LightningIndexer
from engine_deepseek_v4.deepseek_v4.norms import Fp32RMSNorm, unweighted_rms_norm
from engine_deepseek_v4.deepseek_v4.rope import rotate
from engine_deepseek_v4.deepseek_v4.step import Step


class GroupedProjection(nn.Module):
    """``o_a_proj``: weight [groups · rank, in / groups]; group g's slice of the input goes through
    its own [rank, in / groups] block."""

    def __init__(self, in_per_group: int, rank: int, groups: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(groups * rank, in_per_group, dtype=dtype), requires_grad=False)
        self.groups = groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, groups, in / groups] -> [T, groups · rank]."""
        w = self.weight.view(self.groups, -1, self.weight.shape[1])
        return torch.einsum("tgi,goi->tgo", x, w).flatten(1)


@dataclass(frozen=True)
class CacheLayers:
    """The KV-cache layer indices of one attention (None where its type has no such part)."""

    window: int
    compressed: int | None = None
    state: int | None = None
    index_state: int | None = None
    index_keys: int | None = None


class V4Attention(nn.Module):
    def __init__(self, dims: V4Dims, layer_type: str, layers: CacheLayers, dtype: torch.dtype) -> None:
        super().__init__()
        d = self.dims = dims
        self.q_a_proj = Linear(d.hidden_size, d.q_lora_rank, False, dtype)
        self.q_a_norm = Fp32RMSNorm(d.q_lora_rank, d.rms_norm_eps)
        self.q_b_proj = Linear(d.q_lora_rank, d.num_heads * d.head_dim, False, dtype)
        self.kv_proj = Linear(d.hidden_size, d.head_dim, False, dtype)
        self.kv_norm = Fp32RMSNorm(d.head_dim, d.rms_norm_eps)
        self.o_a_proj = GroupedProjection(d.num_heads * d.head_dim // d.o_groups, d.o_lora_rank, d.o_groups, dtype)
        self.o_b_proj = Linear(d.o_groups * d.o_lora_rank, d.hidden_size, False, dtype)
        self.sinks = nn.Parameter(torch.empty(d.num_heads, dtype=torch.float32), requires_grad=False)
        self.layer_type, self.layers = layer_type, layers
        self.compressor = None
        if layer_type != SLIDING:
            ratio = d.ratios[layer_type]
            self.compressor = Compressor(d, ratio, d.head_dim, layer_type == CSA, layers.state, dtype)
            if layer_type == CSA:
                self.compressor.indexer = LightningIndexer(d, ratio, layers.index_state, layers.index_keys, dtype)

    def forward(self, x: torch.Tensor, step: Step, ctx: ForwardContext) -> torch.Tensor:
        d, num_tokens, positions = self.dims, x.shape[0], step.positions
        _, (cos, sin) = step.ropes["main" if self.layer_type == SLIDING else "compress"]
        q_latent = self.q_a_norm(self.q_a_proj(x))
        q = unweighted_rms_norm(self.q_b_proj(q_latent).view(num_tokens, d.num_heads, d.head_dim), d.rms_norm_eps)
        q = rotate(q, cos, sin)
        kv = rotate(self.kv_norm(self.kv_proj(x)), cos, sin)  # [T, head_dim], key and value
        window = step.cache_positions[:, None] - d.sliding_window + 1 + torch.arange(d.sliding_window, device=x.device)
        lse = [torch.empty(num_tokens, d.num_heads, device=x.device)]
        parts = [
            ctx.sparse_attention(self.layers.window, q, kv.unsqueeze(1), window.masked_fill(window < 0, -1), lse[0])
        ]
        if self.compressor is not None:
            compress_rope, compress_cos_sin = step.ropes["compress"]
            entries = self.compressor(x, positions, ctx, compress_rope)
            finished = step.finished(self.compressor.ratio)
            if self.layer_type == CSA:
                finished = self.compressor.indexer.select(
                    x, q_latent, positions, ctx, compress_rope, compress_cos_sin, finished
                )
            lse.append(torch.empty(num_tokens, d.num_heads, device=x.device))
            parts.append(ctx.sparse_attention(self.layers.compressed, q, entries.unsqueeze(1), finished, lse[1]))
        out = merge_with_sinks(parts, lse, self.sinks).to(x.dtype)  # [T, H, head_dim]
        out = rotate(out, cos, sin, inverse=True)  # the values' rope, undone at the query's position
        grouped = self.o_a_proj(out.reshape(num_tokens, d.o_groups, -1))
        return self.o_b_proj(grouped)


def merge_with_sinks(parts: list[torch.Tensor], lse: list[torch.Tensor], sinks: torch.Tensor) -> torch.Tensor:
    """One softmax over every part's keys and a sink logit per head (which takes weight but gives
    no value): Σ_i e^{lse_i} · out_i / (Σ_i e^{lse_i} + e^{sink}), in float32."""
    sink = sinks.float()[None, :].expand_as(lse[0])
    top = torch.stack([*lse, sink]).amax(dim=0)
    weights = [torch.exp(part_lse - top) for part_lse in lse]
    total = sum(weights) + torch.exp(sink - top)
    return sum(w.unsqueeze(-1) * part.float() for w, part in zip(weights, parts)) / total.unsqueeze(-1)
