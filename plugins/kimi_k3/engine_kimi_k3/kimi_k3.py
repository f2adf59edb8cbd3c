"""Kimi-K3 (``KimiK3ForConditionalGeneration``, its language model): KDA layers and gated MLA
layers, latent mixture of experts with SiTU-GLU, and attention residuals.

The text config sits under ``text_config`` and the weights under ``language_model.``; the
vision tower's are skipped (text only). Layer ``i`` is KDA when ``i + 1`` is in
``linear_attn_config.kda_layers``.

- **KDA** as in Kimi Linear (``kimi_linear.py``), but with a lower-bounded gate,
  ``g = gate_lower_bound · σ(exp(A_log_h) · (f_b(f_a(x)) + dt_bias))``, and a full-rank output
  gate ``g_proj`` (``use_full_rank_gate``). ``A_log`` may hold more entries than heads; the
  first ``num_heads`` are used.
- **Gated MLA** with no positional encoding (``mla_use_nope``): the heads' output times
  ``σ(g_proj(x))`` before ``o_proj`` (``mla_use_output_gate``).
- **Latent MoE**: the router (sigmoid, float32, ``e_score_correction_bias``) reads the full
  hidden state; routed experts work at ``routed_expert_hidden_size``:
  ``up(RMSNorm(Σ_e w_e·E_e(down(x)))) + shared(x)`` (the norm when ``latent_moe_use_norm``).
- **SiTU-GLU** in every MLP: ``[β·tanh(g/β)·σ(g)] · [β_lin·tanh(u/β_lin)]`` with
  ``activation_situ_beta`` and ``activation_situ_linear_beta``.
- **Attention residuals** (``attn_res_block_size`` B). The order follows public re-implementations of
  Moonshot's release (its remote code was not at hand):
  - A running ``prefix`` starts as the embeddings, and a list of blocks starts empty.
  - Each layer's attention input is ``prefix`` itself while there is no block, and otherwise a
    softmax mix over the blocks and ``prefix``.
  - At layers ``i ≡ 0 (mod B)`` the prefix is pushed as a block and restarted (from the
    attention's output).
  - The MLP input is the same mix, with its own weights, over the blocks and the prefix now
    holding the attention's output. The MLP's output is added to the prefix.
  - After the last layer a final mix (``model.output_attn_res_*``), then the norm and the
    LM head.
  - A mix scores each value ``v`` with ``Σ_d (v_d / rms(v))·norm_d·proj_d`` and sums the values
    by the softmax of the scores, all in float32.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from engine.distributed import TensorParallel
from engine.interfaces.attention import LINEAR, MLA, AttentionSpec
from engine.interfaces.forward_context import ForwardContext
from engine.interfaces.model import Model, ModelInit
from engine.layers.layernorm import RMSNorm
from engine.layers.linear import Linear, MergedLinear, VocabEmbedding
from engine.layers.mla import MLAttention
from engine.layers.moe import Experts, Router, load_named_tensors
from engine.model_config import HFConfig
from engine_kimi_k3.kimi_linear import (
    EXPERT_PROJ,
    EXPERT_WEIGHT,
    STACKED,
    KimiDeltaAttention,
    KimiDims,
)

logger = logging.getLogger("engine.kimi")


@dataclass(frozen=True)
class K3Dims(KimiDims):
    latent_size: int | None  # routed_expert_hidden_size: the routed experts' width
    latent_norm: bool
    situ_beta: float
    situ_linear_beta: float
    gate_lower_bound: float | None
    full_rank_gate: bool
    mla_output_gate: bool
    attn_res_block_size: int | None

    @classmethod
    def from_config(cls, config: HFConfig) -> K3Dims:
        text = HFConfig(config.to_dict().get("text_config") or config.to_dict())
        base = KimiDims.from_config(text)
        raw = text.to_dict()
        linear = raw.get("linear_attn_config") or {}
        fields = {name: getattr(base, name) for name in base.__dataclass_fields__}
        return cls(
            **fields,
            latent_size=raw.get("routed_expert_hidden_size"),
            latent_norm=bool(raw.get("latent_moe_use_norm", True)),
            situ_beta=float(raw.get("activation_situ_beta", 4.0)),
            situ_linear_beta=float(raw.get("activation_situ_linear_beta", 25.0)),
            gate_lower_bound=linear.get("gate_lower_bound"),
            full_rank_gate=bool(linear.get("use_full_rank_gate", False)),
            mla_output_gate=bool(raw.get("mla_use_output_gate", False)),
            attn_res_block_size=raw.get("attn_res_block_size"),
        )


def situ_glu(gate_up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """[..., 2d] gate then up -> [β·tanh(g/β)·σ(g)] · [β_lin·tanh(u/β_lin)], [..., d]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return (beta * torch.tanh(gate / beta) * torch.sigmoid(gate)) * (linear_beta * torch.tanh(up / linear_beta))


class SituMLP(nn.Module):
    def __init__(
        self, hidden_size: int, intermediate_size: int, dims: K3Dims, dtype: torch.dtype, *, tp: TensorParallel
    ) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size] * 2, False, dtype, tp=tp)
        self.down_proj = Linear(intermediate_size, hidden_size, False, dtype)
        self.betas = (dims.situ_beta, dims.situ_linear_beta)

    def forward(self, x: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
        return self.down_proj(situ_glu(self.gate_up_proj(x), *self.betas))


class LatentMoE(nn.Module):
    def __init__(self, dims: K3Dims, dtype: torch.dtype, *, tp: TensorParallel) -> None:
        super().__init__()
        latent = dims.latent_size or dims.hidden_size
        self.gate = Router(dims)
        self.experts = Experts(
            dims.num_experts,
            dims.moe_intermediate_size,
            latent,
            dtype,
            activation=lambda gate_up: situ_glu(gate_up, dims.situ_beta, dims.situ_linear_beta),
            tp=tp,
        )
        self.latent = dims.latent_size is not None
        if self.latent:
            self.routed_expert_down_proj = Linear(dims.hidden_size, latent, False, dtype)
            self.routed_expert_norm = RMSNorm(latent, dims.norm_eps, dtype) if dims.latent_norm else None
            self.routed_expert_up_proj = Linear(latent, dims.hidden_size, False, dtype)
        self.shared_experts = (
            SituMLP(dims.hidden_size, dims.moe_intermediate_size * dims.num_shared_experts, dims, dtype, tp=tp)
            if dims.num_shared_experts
            else None
        )

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        expert_ids, weights = self.gate(x)
        routed_in = self.routed_expert_down_proj(x) if self.latent else x
        out = self.experts(routed_in, expert_ids, weights, ctx)
        if self.latent:
            if self.routed_expert_norm is not None:
                out = self.routed_expert_norm(out, ops=ctx.ops)
            out = self.routed_expert_up_proj(out)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class K3DeltaAttention(KimiDeltaAttention):
    """KDA with K3's lower-bounded forget gate and, when ``full_rank_gate``, ``g_proj``."""

    def __init__(self, dims: K3Dims, layer_index: int, dtype: torch.dtype, *, tp: TensorParallel) -> None:
        super().__init__(dims, layer_index, dtype, tp=tp)
        self.A_log = nn.Parameter(torch.empty(dims.linear_num_heads, dtype=torch.float32), requires_grad=False)
        self.lower_bound = dims.gate_lower_bound
        if dims.full_rank_gate:
            del self.g_a_proj, self.g_b_proj
            self.g_proj = Linear(dims.hidden_size, self.heads * self.head_dim, False, dtype)
        self.full_rank_gate = dims.full_rank_gate

    def forget_gate(self, x: torch.Tensor) -> torch.Tensor:
        if self.lower_bound is None:
            return super().forget_gate(x)
        gate = (self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()).view(-1, self.heads, self.head_dim)
        return self.lower_bound * torch.sigmoid(self.A_log.float().view(1, self.heads, 1).exp() * gate)

    def output_gate(self, x: torch.Tensor) -> torch.Tensor:
        return self.g_proj(x) if self.full_rank_gate else super().output_gate(x)


class ResidualMix(nn.Module):
    """One attention-residual mix: ``norm.weight`` and ``proj.weight`` [1, hidden] as the
    checkpoint names them ``<name>_norm`` / ``<name>_proj``."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.norm = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.proj = nn.Parameter(torch.empty(1, hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, prefix: torch.Tensor, blocks: list[torch.Tensor]) -> torch.Tensor:
        values = torch.stack([*blocks, prefix], dim=1).float()  # [T, n + 1, hidden]
        normed = values * torch.rsqrt(values.square().mean(-1, keepdim=True) + self.eps) * self.norm.float()
        probs = (normed @ self.proj.float()[0]).softmax(dim=-1)  # [T, n + 1]
        return torch.einsum("tn,tnd->td", probs, values).to(prefix.dtype)


class K3DecoderLayer(nn.Module):
    def __init__(
        self, dims: K3Dims, index: int, specs: dict[str, AttentionSpec], dtype: torch.dtype, *, tp: TensorParallel
    ) -> None:
        super().__init__()
        if dims.layer_types[index] == "full_attention":
            self.self_attn = MLAttention(
                dims, specs["mla"], index, False, dtype, output_gate=dims.mla_output_gate, tp=tp
            )
        else:
            self.self_attn = K3DeltaAttention(dims, index, dtype, tp=tp)
        self.mlp = (
            SituMLP(dims.hidden_size, dims.intermediate_size, dims, dtype, tp=tp)
            if dims.mlp_layer_types[index] == "dense"
            else LatentMoE(dims, dtype, tp=tp)
        )
        self.input_layernorm = RMSNorm(dims.hidden_size, dims.norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(dims.hidden_size, dims.norm_eps, dtype)
        if dims.attn_res_block_size is not None:
            self.self_attention_res = ResidualMix(dims.hidden_size, dims.norm_eps)
            self.mlp_res = ResidualMix(dims.hidden_size, dims.norm_eps)


class KimiK3ForConditionalGeneration(Model):
    tool_parser = "kimi_k3"  # XTML channels, not K2's tokens
    reasoning_parser = "kimi_k3"

    def __init__(self, init: ModelInit) -> None:
        super().__init__()
        dtype, tp = init.dtype, init.tp
        d = self.dims = K3Dims.from_config(init.config)
        self.specs = {
            "mla": AttentionSpec(
                MLA,
                d.num_heads,
                1,
                d.kv_lora_rank + d.qk_rope_head_dim,
                d.qk_head_dim**-0.5,
                latent_size=d.kv_lora_rank,
            ),
            "kda": AttentionSpec(
                LINEAR,
                d.linear_num_heads,
                d.linear_num_heads,
                d.linear_head_dim,
                d.linear_head_dim**-0.5,
                value_size=d.linear_head_dim,
                conv_kernel=d.conv_kernel,
            ),
        }
        with torch.device(init.device):
            self.model = nn.Module()
            self.model.embed_tokens = VocabEmbedding(d.vocab_size, d.hidden_size, dtype, tp=tp)
            self.model.layers = nn.ModuleList(
                K3DecoderLayer(d, i, self.specs, dtype, tp=tp) for i in range(d.num_layers)
            )
            self.model.norm = RMSNorm(d.hidden_size, d.norm_eps, dtype)
            if d.attn_res_block_size is not None:
                self.model.output_attn_res = ResidualMix(d.hidden_size, d.norm_eps)
            self.lm_head = Linear(d.hidden_size, d.vocab_size, False, dtype)

    def kv_cache_specs(self) -> list[AttentionSpec]:
        return [self.specs["mla" if t == "full_attention" else "kda"] for t in self.dims.layer_types]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        block_size = self.dims.attn_res_block_size
        h = self.model.embed_tokens(input_ids)
        if block_size is None:  # plain pre-norm residuals
            for layer in self.model.layers:
                h = h + layer.self_attn(layer.input_layernorm(h, ops=ctx.ops), ctx, None)
                h = h + layer.mlp(layer.post_attention_layernorm(h, ops=ctx.ops), ctx)
            return self.model.norm(h, ops=ctx.ops)
        prefix, blocks = h, []
        for i, layer in enumerate(self.model.layers):
            x = layer.self_attention_res(prefix, blocks) if blocks else prefix
            if i % block_size == 0:  # the prefix closes a block; the next one starts from this attention
                blocks.append(prefix)
                prefix = None
            attended = layer.self_attn(layer.input_layernorm(x, ops=ctx.ops), ctx, None)
            prefix = attended if prefix is None else prefix + attended
            mlp_in = layer.mlp_res(prefix, blocks)
            prefix = prefix + layer.mlp(layer.post_attention_layernorm(mlp_in, ops=ctx.ops), ctx)
        return self.model.norm(self.model.output_attn_res(prefix, blocks), ops=ctx.ops)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        heads, skipped = self.dims.linear_num_heads, 0

        def renamed():
            nonlocal skipped
            for name, tensor in weights:
                if not name.startswith("language_model."):
                    skipped += 1  # the vision tower and its projector: text only
                    continue
                name = name.removeprefix("language_model.").replace(".block_sparse_moe.", ".mlp.")
                name = EXPERT_WEIGHT.sub(lambda m: f".experts.{m.group(1)}.{EXPERT_PROJ[m.group(2)]}.", name)
                name = RESIDUAL_MIX.sub(r".\1.\2", name)
                if name.endswith(".self_attn.A_log"):  # stored with more entries than heads
                    tensor = tensor.flatten()[:heads]
                yield name, tensor

        loaded = load_named_tensors(self, renamed(), STACKED)
        if skipped:
            logger.info("skipped %d tensors outside the language model (vision tower)", skipped)
        return loaded


# self_attention_res_norm.weight -> self_attention_res.norm (the mixes' weights are plain parameters)
RESIDUAL_MIX = re.compile(r"\.(self_attention_res|mlp_res|output_attn_res)_(norm|proj)\.weight$")
