"""Kimi Linear (``KimiLinearForCausalLM``): Kimi delta attention (KDA) layers with MLA layers
between them, routed experts with shared experts.

- **KDA.**
  - q, k and v are projected (here fused into one layer) and pass a causal depthwise short
    convolution with SiLU. q and k are L2-normalised per head, q scaled by ``head_dim^-½``.
  - The forget gate is per channel: ``g = -exp(A_log_h) · softplus(f_b(f_a(x)) + dt_bias)``.
    ``β = σ(b_proj(x))``.
  - The recurrence is the gated delta rule, run by the platform's ``linear`` backend
    (``forward_linear``) from each request's state slot.
  - The output is RMS-normalised per head (float32, weight ``o_norm``), times
    ``σ(g_b(g_a(x)))``, then ``o_proj``.
- **MLA** (``engine.layers.mla``) with no positional encoding: the ``qk_rope_head_dim``
  part of the keys is shared by the heads and not rotated. Scale ``qk_head_dim^-½``.
- **Experts** (``engine.layers.moe``): sigmoid router in float32 with
  ``e_score_correction_bias`` (grouped), renormalised when ``moe_renormalize``, times
  ``routed_scaling_factor``; shared experts; dense layers where ``mlp_layer_types`` says
  ``dense``.

Layer types come from ``layer_types`` or the checkpoints' ``linear_attn_config``
(``kda_layers`` / ``full_attn_layers``, 1-based).

Checkpoints name the MLPs ``block_sparse_moe`` (experts ``w1``/``w3``/``w2``), the forget
gate's weights on the attention (``f_a_proj``, ``f_b_proj``, ``dt_bias``, ``A_log``) and the
convolutions ``q_conv1d``/``k_conv1d``/``v_conv1d``; transformers' own names (``mlp``,
``forget_gate.*``, one stacked ``conv1d``, stacked experts) load as well.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import TensorParallel
from engine.interfaces.attention import LINEAR, MLA, AttentionSpec
from engine.interfaces.forward_context import ForwardContext
from engine.interfaces.model import Model, ModelInit
from engine.layers.decoder import GATE_UP_PARAMS, DecoderStack, GatedMLP, PreNormDecoderLayer, require_silu
from engine.layers.linear import (
    ColumnParallelLinear,
    Linear,
    ParallelLMHead,
    RowParallelLinear,
    gather_argmax,
    gather_logits,
    shard_parameter,
)
from engine.layers.mla import MLADims, MLAttention
from engine.layers.moe import MoE, MoEDims, load_named_tensors
from engine.model_config import HFConfig

# KDA's q/k/v projections are one fused layer; the MLA layers' q_proj stays on its own
STACKED = {**GATE_UP_PARAMS, "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}


@dataclass(frozen=True)
class KimiDims(MLADims, MoEDims):
    """``rms_norm_eps`` is the MLA layers' low-rank norms' (1e-6, as Moonshot builds them);
    ``norm_eps`` the config's, for the decoder's and the KDA output norms."""

    norm_eps: float
    intermediate_size: int
    vocab_size: int
    num_layers: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    linear_num_heads: int
    linear_head_dim: int
    conv_kernel: int

    @classmethod
    def from_config(cls, config: HFConfig) -> KimiDims:
        raw = config.to_dict()
        n = config.num_hidden_layers
        linear = raw.get("linear_attn_config") or {}
        layer_types = raw.get("layer_types")
        if layer_types is None and "kda_layers" in linear:
            layer_types = [None] * n
            for layer in linear.get("full_attn_layers", []):
                layer_types[layer - 1] = "full_attention"
            for layer in linear["kda_layers"]:
                layer_types[layer - 1] = "linear_attention"
        if layer_types is None:  # transformers' default: MLA every fourth layer after the first
            layer_types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
        unknown = sorted({str(t) for t in layer_types[:n] if t not in ("full_attention", "linear_attention")})
        if len(layer_types) < n or unknown:
            raise ValueError(
                f"layer_types must give each of the {n} layers 'full_attention' or 'linear_attention' "
                f"(got {layer_types})."
            )
        mlp_types = raw.get("mlp_layer_types")
        if mlp_types is None:
            dense = int(raw.get("first_k_dense_replace", 1))
            mlp_types = ["dense" if i < dense else "sparse" for i in range(n)]

        def first(*names, default=None):
            return next((raw[name] for name in names if raw.get(name) is not None), default)

        return cls(
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            q_lora_rank=raw.get("q_lora_rank"),
            kv_lora_rank=config.kv_lora_rank,
            qk_nope_head_dim=config.qk_nope_head_dim,
            qk_rope_head_dim=config.qk_rope_head_dim,
            v_head_dim=config.v_head_dim,
            attention_bias=bool(raw.get("attention_bias", False)),
            rms_norm_eps=1e-6,
            norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            moe_intermediate_size=config.moe_intermediate_size,
            num_experts=first("num_experts", "num_local_experts", "n_routed_experts"),
            experts_per_token=first("num_experts_per_token", "num_experts_per_tok"),
            num_groups=first("num_expert_group", "n_group", default=1),
            top_groups=first("topk_group", default=1),
            num_shared_experts=first("num_shared_experts", "n_shared_experts", default=0),
            routed_scaling_factor=float(first("routed_scaling_factor", default=1.0)),
            norm_topk_prob=bool(first("moe_renormalize", "norm_topk_prob", default=True)),
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            num_layers=n,
            layer_types=tuple(layer_types[:n]),
            mlp_layer_types=tuple(mlp_types[:n]),
            linear_num_heads=first("linear_num_heads", default=linear.get("num_heads", 32)),
            linear_head_dim=first("linear_head_dim", default=linear.get("head_dim", 128)),
            conv_kernel=first("linear_conv_kernel_dim", default=linear.get("short_conv_kernel_size", 4)),
        )


class ShortConv(nn.Module):
    """One depthwise convolution's weight, [channels, 1, kernel] as checkpoints hold it (this
    rank's ``channels`` of ``full_channels``, from ``first``)."""

    def __init__(
        self, channels: int, kernel: int, dtype: torch.dtype, first: int = 0, full_channels: int | None = None
    ) -> None:
        super().__init__()
        self.weight = shard_parameter(
            nn.Parameter(torch.empty(channels, 1, kernel, dtype=dtype), requires_grad=False),
            0,
            first,
            full_channels or channels,
        )


class GatedHeadNorm(nn.Module):
    """``o_norm``: RMS over each head's values in float32, times the weight and ``σ(gate)``."""

    def __init__(self, head_dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps) * self.weight.float()
        return (normed * torch.sigmoid(gate.float())).to(x.dtype)


class KimiDeltaAttention(nn.Module):
    """Under tensor parallelism each rank runs its KDA heads: the per-head and per-channel
    projections, convolutions, decays and state are split by head, the low-rank gates' first
    factors (``f_a``, ``g_a``) are whole on every rank, and ``o_proj`` sums over the ranks of ``tp``."""

    def __init__(self, dims: KimiDims, layer_index: int, dtype: torch.dtype, *, tp: TensorParallel) -> None:
        super().__init__()
        all_heads, head_dim = dims.linear_num_heads, dims.linear_head_dim
        first, heads = tp.split(all_heads, "linear_num_heads")  # this rank's heads
        full_width, width, first_channel = all_heads * head_dim, heads * head_dim, first * head_dim
        what = "linear_num_heads × head_dim"
        self.qkv_proj = ColumnParallelLinear(dims.hidden_size, [full_width] * 3, False, dtype, what, tp=tp)
        self.q_conv1d = ShortConv(width, dims.conv_kernel, dtype, first_channel, full_width)
        self.k_conv1d = ShortConv(width, dims.conv_kernel, dtype, first_channel, full_width)
        self.v_conv1d = ShortConv(width, dims.conv_kernel, dtype, first_channel, full_width)
        # the forget gate: g = -exp(A_log_h) · softplus(f_b(f_a(x)) + dt_bias), per channel
        self.f_a_proj = Linear(dims.hidden_size, head_dim, False, dtype)
        self.f_b_proj = ColumnParallelLinear(head_dim, [full_width], False, dtype, what, tp=tp)
        self.dt_bias = shard_parameter(
            nn.Parameter(torch.empty(width, dtype=torch.float32), requires_grad=False), 0, first_channel, full_width
        )
        self.A_log = shard_parameter(
            nn.Parameter(torch.empty(1, 1, heads, 1, dtype=torch.float32), requires_grad=False), 2, first, all_heads
        )
        self.b_proj = ColumnParallelLinear(dims.hidden_size, [all_heads], False, dtype, "linear_num_heads", tp=tp)
        self.g_a_proj = Linear(dims.hidden_size, head_dim, False, dtype)
        self.g_b_proj = ColumnParallelLinear(head_dim, [full_width], False, dtype, what, tp=tp)
        self.o_norm = GatedHeadNorm(head_dim, dims.norm_eps)
        self.o_proj = RowParallelLinear(full_width, dims.hidden_size, False, dtype, what, tp=tp)
        self.layer_index, self.heads, self.head_dim = layer_index, heads, head_dim

    def forget_gate(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> log decays [T, heads, head_dim], float32."""
        gate = (self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()).view(-1, self.heads, self.head_dim)
        decay_rate = self.A_log.float().view(1, self.heads, 1).exp()
        return -decay_rate * F.softplus(gate, threshold=20.0)

    def output_gate(self, x: torch.Tensor) -> torch.Tensor:
        """The output gate's logits [T, heads · head_dim] (low rank: g_b(g_a(x)))."""
        return self.g_b_proj(self.g_a_proj(x))

    def forward(self, x: torch.Tensor, ctx: ForwardContext, cos_sin=None) -> torch.Tensor:
        beta = torch.sigmoid(self.b_proj(x).float())  # [T, heads]
        conv = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight]).squeeze(1)
        out = ctx.linear(self.layer_index, self.qkv_proj(x), conv, self.forget_gate(x), beta)
        gate = self.output_gate(x).view(-1, self.heads, self.head_dim)
        return self.o_proj(self.o_norm(out, gate).reshape(x.shape[0], -1))


class KimiLinearForCausalLM(Model):
    supports_tensor_parallel = True
    tool_parser = "kimi_k2"  # Kimi-Linear-Instruct writes K2's calls and does not think

    def __init__(self, init: ModelInit) -> None:
        super().__init__()
        config, dtype, tp = init.config, init.dtype, init.tp
        require_silu(config, self)
        d = self.dims = KimiDims.from_config(config)
        # the specs count this rank's heads
        mla_heads, kda_heads = (
            tp.split(d.num_heads, "num_attention_heads")[1],
            tp.split(d.linear_num_heads, "linear_num_heads")[1],
        )
        self.mla_spec = AttentionSpec(
            MLA, mla_heads, 1, d.kv_lora_rank + d.qk_rope_head_dim, d.qk_head_dim**-0.5, latent_size=d.kv_lora_rank
        )
        self.kda_spec = AttentionSpec(
            LINEAR,
            kda_heads,
            kda_heads,
            d.linear_head_dim,
            d.linear_head_dim**-0.5,
            value_size=d.linear_head_dim,
            conv_kernel=d.conv_kernel,
            total_num_heads=d.linear_num_heads if tp.is_parallel else None,
        )
        layers = []
        with torch.device(init.device):
            for i, layer_type in enumerate(d.layer_types):
                attention = (
                    MLAttention(d, self.mla_spec, i, False, dtype, tp=tp)
                    if layer_type == "full_attention"
                    else KimiDeltaAttention(d, i, dtype, tp=tp)
                )
                mlp = (
                    GatedMLP(d.hidden_size, d.intermediate_size, False, dtype, tp=tp)
                    if d.mlp_layer_types[i] == "dense"
                    else MoE(d, dtype, tp=tp)
                )
                layers.append(PreNormDecoderLayer(attention, mlp, d.hidden_size, d.norm_eps, dtype))
            self.model = DecoderStack(d.vocab_size, d.hidden_size, d.norm_eps, layers, dtype, tp=tp)
            self.lm_head = ParallelLMHead(d.hidden_size, d.vocab_size, dtype, tp=tp)

    def kv_cache_specs(self) -> list[AttentionSpec]:
        return [self.mla_spec if t == "full_attention" else self.kda_spec for t in self.dims.layer_types]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.model(input_ids, ctx, lambda dtype: None)  # no positional encoding anywhere

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return gather_logits(self.lm_head, hidden_states)

    def compute_greedy_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return gather_argmax(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def renamed():
            for name, tensor in weights:
                name = name.replace(".block_sparse_moe.", ".mlp.").replace(".forget_gate.", ".")
                name = EXPERT_WEIGHT.sub(lambda m: f".experts.{m.group(1)}.{EXPERT_PROJ[m.group(2)]}.", name)
                if name.endswith(".self_attn.conv1d.weight"):  # transformers' stacked q/k/v convolutions
                    prefix = name.removesuffix("conv1d.weight")
                    for part, chunk in zip("qkv", tensor.chunk(3, dim=0)):
                        yield f"{prefix}{part}_conv1d.weight", chunk
                    continue
                yield name, tensor

        return load_named_tensors(self, renamed(), STACKED)


EXPERT_WEIGHT = re.compile(r"\.experts\.(\d+)\.(w1|w2|w3)\.")
EXPERT_PROJ = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
