"""DeepSeek-V3 (and Kimi-K2, the same architecture): multi-head latent attention and a
routed mixture of experts with shared experts; DeepSeek-V3.2, the same network with
DeepSeek sparse attention.

MLA runs in the absorbed form in prefill and decode alike: each head's query is moved
into the latent space (``q̃ = W_UKᵀ q_nope``), the attention backend scores it against
the cached latents ``[c; k_rope]`` (one entry a token, shared by every head) and sums
the latents, and ``W_UV`` lifts the result per head. ``kv_b_proj``'s weight is split
into ``W_UK`` and ``W_UV`` after loading; quantizers leave it alone (it is read as a
matrix, not applied as a linear layer).

V3.2 adds a lightning indexer to every attention layer: its own keys (``wk``, a
LayerNorm, rope on the first ``qk_rope_head_dim`` dims, not interleaved) cached in
their own KV-cache group, queries from the q_lora latent (``wq_b``), and per-head
weights (``weights_proj``, in float32). Each query attends only to the
``index_topk`` positions scoring best, ``Σ_h w_h · relu(q_h·k / √d)``; the indexer
and the sparse-MLA attention are attention backends (kinds ``indexer`` and
``sparse_mla``), so a platform can bring kernels for both. When no sequence of a
step is longer than ``index_topk`` every position is selected, as dense MLA.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

import torch.nn.functional as F

from engine.interfaces.attention import INDEXER, MLA, SPARSE_MLA, AttentionSpec
from engine.interfaces.model import Model, ModelInit
from engine.layers.attention import Attention
from engine.layers.layernorm import RMSNorm
from engine.layers.decoder import (
    GATE_UP_PARAMS,
    DecoderStack,
    GatedMLP,
    PreNormDecoderLayer,
    load_tensor,
    require_silu,
)
from engine.layers.linear import Linear, linear_layers
from engine.layers.rotary import RotaryEmbedding, rope_parameters, yarn_mscale
from engine.model_config import HFConfig
from engine.runtime.forward_context import ForwardContext

logger = logging.getLogger("engine.deepseek")

EXPERT_TENSOR = re.compile(r"(?P<moe>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
FUSED_EXPERT_TENSOR = re.compile(r"(?P<moe>.+\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)$")


@dataclass(frozen=True)
class Dims:
    hidden_size: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    moe_intermediate_size: int
    num_experts: int
    experts_per_token: int
    num_groups: int
    top_groups: int
    num_shared_experts: int
    first_k_dense_replace: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    attention_bias: bool
    vocab_size: int
    num_layers: int
    rms_norm_eps: float
    mlp_layer_types: tuple[str, ...] | None = None  # "dense" / "sparse" per layer, when the config lists them
    # V3.2's indexer: query heads, head size, positions selected per query (None: no indexer)
    index_n_heads: int | None = None
    index_head_dim: int | None = None
    index_topk: int | None = None

    @classmethod
    def from_config(cls, config: HFConfig) -> Dims:
        return cls(
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            q_lora_rank=config.get("q_lora_rank"),
            kv_lora_rank=config.kv_lora_rank,
            qk_nope_head_dim=config.qk_nope_head_dim,
            qk_rope_head_dim=config.qk_rope_head_dim,
            v_head_dim=config.v_head_dim,
            intermediate_size=config.intermediate_size,
            moe_intermediate_size=config.moe_intermediate_size,
            num_experts=config.get("n_routed_experts") or config.get("num_local_experts"),
            experts_per_token=config.num_experts_per_tok,
            num_groups=config.get("n_group", 1) or 1,
            top_groups=config.get("topk_group", 1) or 1,
            num_shared_experts=config.get("n_shared_experts", 0) or 0,
            first_k_dense_replace=config.get("first_k_dense_replace", 0),
            routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(config.get("norm_topk_prob", True)),
            attention_bias=bool(config.get("attention_bias", False)),
            vocab_size=config.vocab_size,
            num_layers=config.num_hidden_layers,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            mlp_layer_types=tuple(config.mlp_layer_types) if config.get("mlp_layer_types") else None,
        )

    def with_indexer(self, config: HFConfig) -> Dims:
        """These dims with V3.2's indexer (``index_n_heads``, ``index_head_dim``, ``index_topk``)."""
        from dataclasses import replace

        if self.q_lora_rank is None:
            raise ValueError("DeepSeek sparse attention's indexer reads the q_lora latent: q_lora_rank must be set.")
        head_dim = int(config.get("index_head_dim", 128))
        if head_dim < self.qk_rope_head_dim:
            raise ValueError(f"index_head_dim={head_dim} is smaller than qk_rope_head_dim={self.qk_rope_head_dim}.")
        return replace(self, index_n_heads=int(config.get("index_n_heads", 64)), index_head_dim=head_dim,
                       index_topk=int(config.get("index_topk", 2048)))

    def is_moe(self, layer_index: int) -> bool:
        """Whether layer ``layer_index`` routes experts (``mlp_layer_types`` when listed, else
        every layer from ``first_k_dense_replace`` on; multi-token-prediction layers do)."""
        if self.mlp_layer_types is not None and layer_index < len(self.mlp_layer_types):
            return self.mlp_layer_types[layer_index] == "sparse"
        return layer_index >= self.first_k_dense_replace

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def softmax_scale(dims: Dims, rope: dict) -> float:
    """qk_head_dim^-½, times YaRN's mscale² when the rope is scaled with ``mscale_all_dim``."""
    scale = dims.qk_head_dim**-0.5
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        mscale = yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"]))
        scale *= mscale * mscale
    return scale


class LatentUpProjection(nn.Module):
    """``kv_b_proj``: weight [H * (qk_nope + v), kv_lora_rank], held as a matrix and split
    per head into W_UK [H, qk_nope, R] and W_UV [H, v, R] for the absorbed form."""

    def __init__(self, dims: Dims, dtype: torch.dtype) -> None:
        super().__init__()
        rows = dims.num_heads * (dims.qk_nope_head_dim + dims.v_head_dim)
        self.weight = nn.Parameter(torch.empty(rows, dims.kv_lora_rank, dtype=dtype), requires_grad=False)
        self.dims = dims

    def split(self) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.dims
        per_head = self.weight.view(d.num_heads, d.qk_nope_head_dim + d.v_head_dim, d.kv_lora_rank)
        return per_head[:, : d.qk_nope_head_dim], per_head[:, d.qk_nope_head_dim :]


class Fp32Projection(nn.Module):
    """A bias-free projection kept and applied in float32 (the indexer's ``weights_proj``),
    left alone by quantizers as transformers leaves it."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight)


class Indexer(nn.Module):
    """V3.2's lightning indexer for one attention layer; its keys are KV-cache layer ``layer_index``."""

    def __init__(self, dims: Dims, layer_index: int, dtype: torch.dtype) -> None:
        super().__init__()
        d = self.dims = dims
        self.wq_b = Linear(d.q_lora_rank, d.index_n_heads * d.index_head_dim, False, dtype)
        self.wk = Linear(d.hidden_size, d.index_head_dim, False, dtype)
        self.k_norm = nn.LayerNorm(d.index_head_dim, eps=1e-6, dtype=dtype)
        self.weights_proj = Fp32Projection(d.hidden_size, d.index_n_heads)
        self.layer_index = layer_index

    def forward(self, x: torch.Tensor, q_latent: torch.Tensor, ctx: ForwardContext,
                cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor | None:
        """x [T, hidden], q_latent [T, q_lora_rank] (after q_a_layernorm) -> the selected
        positions [T, index_topk] (-1 padding), or None for all."""
        d, num_tokens = self.dims, x.shape[0]
        rope = d.qk_rope_head_dim
        q = self.wq_b(q_latent).view(num_tokens, d.index_n_heads, d.index_head_dim)
        k = self.k_norm(self.wk(x)).view(num_tokens, 1, d.index_head_dim)
        q_rope, k_rope = ctx.ops.rotary(q[..., :rope].contiguous(), k[..., :rope].contiguous(), *cos_sin)
        q = torch.cat([q_rope, q[..., rope:]], dim=-1)
        k = torch.cat([k_rope, k[..., rope:]], dim=-1)
        weights = self.weights_proj(x) * d.index_n_heads**-0.5  # [T, heads] float32
        return ctx.index(self.layer_index, q, k, weights)


def indexer_spec(dims: Dims) -> AttentionSpec:
    """The KV-cache spec of V3.2's indexer keys."""
    return AttentionSpec(kind=INDEXER, num_heads=dims.index_n_heads, num_kv_heads=1, head_size=dims.index_head_dim,
                         scale=dims.index_head_dim**-0.5, index_topk=dims.index_topk)


class MLAttention(nn.Module):
    def __init__(self, dims: Dims, spec: AttentionSpec, layer_index: int, interleaved_rope: bool,
                 dtype: torch.dtype, index_layer: int | None = None) -> None:
        super().__init__()
        d = self.dims = dims
        bias = dims.attention_bias
        if d.q_lora_rank is None:
            self.q_proj = Linear(d.hidden_size, d.num_heads * d.qk_head_dim, False, dtype)
        else:
            self.q_a_proj = Linear(d.hidden_size, d.q_lora_rank, bias, dtype)
            self.q_a_layernorm = RMSNorm(d.q_lora_rank, d.rms_norm_eps, dtype)
            self.q_b_proj = Linear(d.q_lora_rank, d.num_heads * d.qk_head_dim, False, dtype)
        self.kv_a_proj_with_mqa = Linear(d.hidden_size, d.kv_lora_rank + d.qk_rope_head_dim, bias, dtype)
        self.kv_a_layernorm = RMSNorm(d.kv_lora_rank, d.rms_norm_eps, dtype)
        self.kv_b_proj = LatentUpProjection(d, dtype)
        self.o_proj = Linear(d.num_heads * d.v_head_dim, d.hidden_size, bias, dtype)
        self.interleaved_rope = interleaved_rope
        self.attn = Attention(layer_index, spec)
        # sparse MLA: the indexer, its keys at KV-cache layer index_layer
        self.indexer = Indexer(d, index_layer, dtype) if spec.kind == SPARSE_MLA else None

    def forward(self, x: torch.Tensor, ctx: ForwardContext, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        d, num_tokens = self.dims, x.shape[0]
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
        return self.o_proj(out.reshape(num_tokens, d.num_heads * d.v_head_dim))


class Router(nn.Module):
    """Sigmoid scores; experts chosen by score + ``e_score_correction_bias`` among the
    ``topk_group`` best groups (a group's worth: its two best biased scores); weights are
    the unbiased scores, normalised when ``norm_topk_prob``, times ``routed_scaling_factor``.
    In float32, as transformers computes it."""

    def __init__(self, dims: Dims) -> None:
        super().__init__()
        self.dims = dims
        self.weight = nn.Parameter(torch.empty(dims.num_experts, dims.hidden_size), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.empty(dims.num_experts), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden] -> (expert ids [T, k], weights [T, k] fp32)."""
        d = self.dims
        scores = torch.nn.functional.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        biased = scores + self.e_score_correction_bias.float()
        per_group = biased.view(-1, d.num_groups, d.num_experts // d.num_groups)
        group_scores = per_group.topk(min(2, per_group.shape[-1]), dim=-1)[0].sum(dim=-1)  # [T, G]
        best_groups = group_scores.topk(d.top_groups, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
        allowed = group_mask.repeat_interleave(d.num_experts // d.num_groups, dim=1)
        chosen = biased.masked_fill(~allowed, float("-inf")).topk(d.experts_per_token, dim=-1, sorted=False)[1]
        weights = scores.gather(1, chosen)
        if d.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return chosen, weights * d.routed_scaling_factor


class Experts(nn.Module):
    """The routed experts' weights stacked: w13 [E, 2 * I, hidden] (gate rows then up
    rows) and w2 [E, hidden, I]. Tokens are sorted by expert and each active expert runs
    one pair of matmuls over all of its tokens. With ``swiglu_limit`` (DeepSeek-V4) the
    gate is clamped to at most the limit and the up projection to ±limit before
    ``silu(gate) * up``."""

    def __init__(self, num_experts: int, intermediate_size: int, hidden_size: int, dtype: torch.dtype,
                 swiglu_limit: float | None = None) -> None:
        super().__init__()
        e, i, h = num_experts, intermediate_size, hidden_size
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, h, i, dtype=dtype), requires_grad=False)
        self.intermediate_size = i
        self.swiglu_limit = swiglu_limit
        self._loaded: set[tuple[int, str]] = set()

    def load(self, expert: int, proj: str, tensor: torch.Tensor) -> bool:
        """One expert's ``gate_proj`` / ``up_proj`` / ``down_proj`` weight; True once all are in."""
        i = self.intermediate_size
        target = {"gate_proj": self.w13.data[expert, :i], "up_proj": self.w13.data[expert, i:],
                  "down_proj": self.w2.data[expert]}[proj]
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"Expert {expert} {proj}: model expects {tuple(target.shape)}, checkpoint has "
                             f"{tuple(tensor.shape)}.")
        target.copy_(tensor)
        self._loaded.add((expert, proj))
        return len(self._loaded) == 3 * self.w13.shape[0]

    def load_fused(self, proj: str, tensor: torch.Tensor) -> bool:
        """transformers' stacked layout: ``gate_up_proj`` [E, 2I, hidden], ``down_proj`` [E, hidden, I]."""
        target = self.w13 if proj == "gate_up_proj" else self.w2
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"experts.{proj}: model expects {tuple(target.shape)}, checkpoint has {tuple(tensor.shape)}.")
        target.data.copy_(tensor)
        names = ("gate_proj", "up_proj") if proj == "gate_up_proj" else ("down_proj",)
        self._loaded.update((e, n) for e in range(self.w13.shape[0]) for n in names)
        return len(self._loaded) == 3 * self.w13.shape[0]

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x [T, hidden], expert_ids / weights [T, k] -> Σ_k weight · expert(x) [T, hidden]."""
        k = expert_ids.shape[1]
        flat = expert_ids.flatten()
        order = flat.argsort(stable=True)
        token_of = order // k  # the token behind each (token, choice) in expert order
        counts = torch.bincount(flat, minlength=self.w13.shape[0]).tolist()
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = order[start : start + count]
            tokens = token_of[start : start + count]
            start += count
            h = self.activation(x[tokens] @ self.w13[expert].t(), ctx) @ self.w2[expert].t()
            out.index_add_(0, tokens, h.float() * weights.flatten()[rows].unsqueeze(1))
        return out.to(x.dtype)

    def activation(self, gate_up: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        if self.swiglu_limit is None:
            return ctx.ops.silu_and_mul(gate_up)
        return clamped_swiglu(gate_up, self.swiglu_limit)


def clamped_swiglu(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """[..., 2d] gate then up -> silu(min(gate, limit)) * clamp(up, -limit, limit)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class MoE(nn.Module):
    def __init__(self, dims: Dims, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate = Router(dims)
        self.experts = Experts(dims.num_experts, dims.moe_intermediate_size, dims.hidden_size, dtype)
        self.shared_experts = (
            GatedMLP(dims.hidden_size, dims.moe_intermediate_size * dims.num_shared_experts, False, dtype)
            if dims.num_shared_experts else None
        )

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        expert_ids, weights = self.gate(x)
        out = self.experts(x, expert_ids, weights, ctx)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x, ctx)
        return out


def attention_spec(dims: Dims, rope: dict) -> AttentionSpec:
    """The KV-cache spec of the MLA layers (sparse MLA when the dims have an indexer)."""
    return AttentionSpec(
        kind=MLA if dims.index_topk is None else SPARSE_MLA, num_heads=dims.num_heads, num_kv_heads=1,
        head_size=dims.kv_lora_rank + dims.qk_rope_head_dim, scale=softmax_scale(dims, rope),
        latent_size=dims.kv_lora_rank,
    )


class DeepseekV3ForCausalLM(Model):
    sparse_attention = False  # V3.2: an indexer in every layer

    def __init__(self, init: ModelInit) -> None:
        super().__init__()
        config, dtype = init.config, init.dtype
        require_silu(config, self)
        d = Dims.from_config(config)
        self.dims = d = d.with_indexer(config) if self.sparse_attention else d
        if d.num_experts % d.num_groups:
            raise ValueError(f"n_routed_experts={d.num_experts} is not a multiple of n_group={d.num_groups}.")
        rope = rope_parameters(config)
        self.spec = attention_spec(d, rope)
        self.num_mtp_layers = int(config.get("num_nextn_predict_layers", 0) or 0)
        interleaved = bool(config.get("rope_interleave", True))
        n = d.num_layers
        with torch.device(init.device):
            # the indexers' keys are KV-cache layers n .. 2n - 1
            layers = [decoder_layer(d, self.spec, i, i, interleaved, dtype, n + i if self.sparse_attention else None)
                      for i in range(n)]
            self.model = DecoderStack(d.vocab_size, d.hidden_size, d.rms_norm_eps, layers, dtype)
            self.rotary = RotaryEmbedding(d.qk_rope_head_dim, int(config.get("max_position_embeddings", 4096)), rope)
            self.tie_word_embeddings = bool(config.get("tie_word_embeddings", False))
            self.lm_head = Linear(d.hidden_size, d.vocab_size, False, dtype)
            if self.tie_word_embeddings:
                self.lm_head.weight = self.model.embed_tokens.weight

    def kv_cache_specs(self) -> list[AttentionSpec]:
        specs = [self.spec] * self.dims.num_layers
        if self.sparse_attention:
            specs += [indexer_spec(self.dims)] * self.dims.num_layers
        return specs

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.model(input_ids, ctx, lambda dtype: self.rotary.cos_sin(positions, dtype))

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        skipped_mtp = 0

        def main_model_tensors():
            nonlocal skipped_mtp
            for name, tensor in weights:
                if name.startswith("lm_head.") and self.tie_word_embeddings:
                    continue
                layer = re.match(r"model\.layers\.(\d+)\.", name)
                if layer and int(layer.group(1)) >= self.dims.num_layers and self.num_mtp_layers:
                    skipped_mtp += 1  # multi-token-prediction layers: the mtp proposer's weights
                    continue
                yield name, tensor

        loaded = load_named_tensors(self, main_model_tensors())
        if skipped_mtp:
            logger.info("skipped %d multi-token-prediction tensors (layers >= %d)", skipped_mtp, self.dims.num_layers)
        return loaded


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V3.2: V3 with DeepSeek sparse attention (an indexer in every layer)."""

    sparse_attention = True


def load_named_tensors(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Fill ``module`` (a DeepSeek model or MTP layer, by its own parameter names) from
    checkpoint tensors: routed experts, linear layers (fused gate/up included) and plain
    parameters; returns the parameter names filled. An unknown tensor is a ``KeyError``."""
    params, linears = dict(module.named_parameters()), linear_layers(module)
    loaded: set[str] = set()
    for name, tensor in weights:
        if name.endswith("rotary_emb.inv_freq"):
            continue
        expert = EXPERT_TENSOR.match(name)
        fused = FUSED_EXPERT_TENSOR.match(name)
        if expert or fused:
            match = expert or fused
            experts = module.get_submodule(match.group("moe"))
            done = (experts.load(int(expert.group("expert")), expert.group("proj"), tensor) if expert
                    else experts.load_fused(fused.group("proj"), tensor))
            if done:
                loaded.update(f"{match.group('moe')}.{p}" for p in ("w13", "w2"))
            continue
        loaded |= load_tensor(module, params, linears, name, tensor, GATE_UP_PARAMS)
    return loaded


def decoder_layer(dims: Dims, spec: AttentionSpec, layer_index: int, attention_index: int, interleaved_rope: bool,
                  dtype: torch.dtype, index_layer: int | None = None) -> PreNormDecoderLayer:
    """Decoder layer ``layer_index`` of the network (a dense MLP or routed experts, see
    :meth:`Dims.is_moe`), its attention at ``attention_index`` of the KV-cache specs and, for
    sparse MLA, its indexer's keys at ``index_layer``."""
    mlp = MoE(dims, dtype) if dims.is_moe(layer_index) else GatedMLP(dims.hidden_size, dims.intermediate_size, False,
                                                                     dtype)
    return PreNormDecoderLayer(MLAttention(dims, spec, attention_index, interleaved_rope, dtype, index_layer), mlp,
                               dims.hidden_size, dims.rms_norm_eps, dtype)
