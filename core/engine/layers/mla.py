"""Multi-head latent attention (DeepSeek-V2/V3, Kimi), shared by model plugins.

The KV cache holds one latent entry per token, ``[c; k_rope]`` (``kv_lora_rank +
qk_rope_head_dim`` values shared by every head). Attention runs in the absorbed form in
prefill and decode alike: each head's query is moved into the latent space
(``q̃ = W_UKᵀ q_nope``), the attention backend scores it against the cached entries and
sums the latents, and ``W_UV`` lifts the result per head. ``kv_b_proj``'s weight is split
into ``W_UK`` and ``W_UV``; quantizers leave it alone (it is read as a matrix).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.distributed.parallel_state import TensorParallel, resolve_tp
from engine.interfaces.attention import AttentionSpec
from engine.layers.attention import Attention
from engine.layers.layernorm import RMSNorm
from engine.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear, shard_parameter

if TYPE_CHECKING:
    from engine.interfaces.forward_context import ForwardContext


@dataclass(frozen=True)
class MLADims:
    """The sizes of an MLA layer, by their HF config names."""

    hidden_size: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    attention_bias: bool
    rms_norm_eps: float

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


class LatentUpProjection(nn.Module):
    """``kv_b_proj``: weight [H * (qk_nope + v), kv_lora_rank], held as a matrix and split
    per head into W_UK [H, qk_nope, R] and W_UV [H, v, R] for the absorbed form. ``dims``
    are this rank's (its heads); ``first_head`` is where they start among ``num_heads``, the
    checkpoint's."""

    def __init__(self, dims: MLADims, dtype: torch.dtype, first_head: int = 0, num_heads: int | None = None) -> None:
        super().__init__()
        per_head = dims.qk_nope_head_dim + dims.v_head_dim
        weight = nn.Parameter(
            torch.empty(dims.num_heads * per_head, dims.kv_lora_rank, dtype=dtype), requires_grad=False
        )
        self.weight = shard_parameter(weight, 0, first_head * per_head, (num_heads or dims.num_heads) * per_head)
        self.dims = dims

    def split(self) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.dims
        per_head = self.weight.view(d.num_heads, d.qk_nope_head_dim + d.v_head_dim, d.kv_lora_rank)
        return per_head[:, : d.qk_nope_head_dim], per_head[:, d.qk_nope_head_dim :]


class MLAttention(nn.Module):
    """Multi-head latent attention in the absorbed form. ``indexer`` (DeepSeek-V3.2's, a module
    ``(x, q_latent, ctx, cos_sin) -> indices | None``) makes it sparse MLA; ``cos_sin`` None at
    forward leaves the rope dims unrotated (Kimi's MLA has no positional encoding)."""

    def __init__(
        self,
        dims: MLADims,
        spec: AttentionSpec,
        layer_index: int,
        interleaved_rope: bool,
        dtype: torch.dtype,
        indexer: nn.Module | None = None,
        output_gate: bool = False,
        *,
        tp: TensorParallel | None = None,
    ) -> None:
        """``output_gate`` (Kimi-K3's gated MLA): the heads' output times ``σ(g_proj(x))`` before
        ``o_proj``. ``tp``: the ranks that split the heads."""
        super().__init__()
        d = dims
        bias = dims.attention_bias
        # under tensor parallelism each rank has its heads: q/g by rows, kv_b_proj's heads, o_proj by
        # columns; the latent (q_a, kv_a) is computed whole on every rank, as it is cached whole
        tp = resolve_tp(tp)
        first_head, num_heads = tp.split(d.num_heads, "num_attention_heads")
        what = "num_attention_heads × head dim"
        if d.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(d.hidden_size, [d.num_heads * d.qk_head_dim], False, dtype, what, tp=tp)
        else:
            self.q_a_proj = Linear(d.hidden_size, d.q_lora_rank, bias, dtype)
            self.q_a_layernorm = RMSNorm(d.q_lora_rank, d.rms_norm_eps, dtype)
            self.q_b_proj = ColumnParallelLinear(
                d.q_lora_rank, [d.num_heads * d.qk_head_dim], False, dtype, what, tp=tp
            )
        self.kv_a_proj_with_mqa = Linear(d.hidden_size, d.kv_lora_rank + d.qk_rope_head_dim, bias, dtype)
        self.kv_a_layernorm = RMSNorm(d.kv_lora_rank, d.rms_norm_eps, dtype)
        self.dims = replace(dims, num_heads=num_heads)  # this rank's heads
        self.kv_b_proj = LatentUpProjection(self.dims, dtype, first_head, d.num_heads)
        self.o_proj = RowParallelLinear(d.num_heads * d.v_head_dim, d.hidden_size, bias, dtype, what, tp=tp)
        self.g_proj = (
            ColumnParallelLinear(d.hidden_size, [d.num_heads * d.v_head_dim], False, dtype, what, tp=tp)
            if output_gate
            else None
        )
        self.interleaved_rope = interleaved_rope
        self.attn = Attention(layer_index, spec)
        self.indexer = indexer  # sparse MLA: picks the positions each query attends to

    def forward(
        self, x: torch.Tensor, ctx: ForwardContext, cos_sin: tuple[torch.Tensor, torch.Tensor] | None
    ) -> torch.Tensor:
        d, num_tokens = self.dims, x.shape[0]  # d.num_heads: this rank's
        if d.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q_latent = self.q_a_layernorm(self.q_a_proj(x), ops=ctx.ops)
            q = self.q_b_proj(q_latent)
        q = q.view(num_tokens, d.num_heads, d.qk_head_dim)
        q_nope, q_rope = q.split([d.qk_nope_head_dim, d.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([d.kv_lora_rank, d.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous(), ops=ctx.ops)  # [T, R]
        k_rope = k_rope.reshape(num_tokens, 1, d.qk_rope_head_dim)
        if cos_sin is not None:
            if self.interleaved_rope:  # pairs (x0, x1), (x2, x3), ...: evens then odds, then rotate-half
                q_rope = torch.cat([q_rope[..., 0::2], q_rope[..., 1::2]], dim=-1)
                k_rope = torch.cat([k_rope[..., 0::2], k_rope[..., 1::2]], dim=-1)
            q_rope, k_rope = ctx.ops.rotary(q_rope.contiguous(), k_rope.contiguous(), *cos_sin)
        w_uk, w_uv = self.kv_b_proj.split()
        q_absorbed = torch.einsum("thn,hnr->thr", q_nope, w_uk)  # [T, H, R]
        query = torch.cat([q_absorbed, q_rope], dim=-1)  # [T, H, R + r]
        entry = torch.cat([latent.unsqueeze(1), k_rope], dim=-1)  # [T, 1, R + r]
        if self.indexer is None:
            out = self.attn(query, entry, None, ctx)  # [T, H, R]
        else:
            indices = self.indexer(x, q_latent, ctx, cos_sin)
            out = ctx.sparse_attention(self.attn.layer_index, query, entry, indices)
        out = torch.einsum("thr,hvr->thv", out, w_uv)  # [T, H, v]
        out = out.reshape(num_tokens, d.num_heads * d.v_head_dim)
        if self.g_proj is not None:
            out = out * torch.sigmoid(self.g_proj(x))
        return self.o_proj(out)
