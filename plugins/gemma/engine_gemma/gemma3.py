"""Gemma 3 (the text model, ``Gemma3ForCausalLM``), built from the engine's layers.

What sets it apart from Llama: sliding-window (local) and global attention layers interleaved
as ``layer_types`` lists them, each kind with its own rope base (and the global ones with the
config's rope scaling); RMS norms on every head's queries and keys; a norm before and after
both the attention and the MLP; norms that scale by ``1 + weight``; the embedding scaled by
``sqrt(hidden_size)`` (rounded to the compute dtype, as transformers does); a softmax scale of
``query_pre_attn_scalar ** -0.5``; a tanh-GELU gated MLP; optionally the final logits capped
by ``cap · tanh(logits / cap)``.

The two kinds of layer have different specs, so the engine gives each its own KV-cache group
(and its own backend: ``sliding_window`` for the local layers, ``mha`` for the global ones).

Fields a config leaves out take transformers' ``Gemma3TextConfig`` defaults. The published
multimodal checkpoints (``Gemma3ForConditionalGeneration``) serve this text model on text prompts:
see ``gemma3_multimodal``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import TensorParallel
from engine.interfaces.attention import MHA, SLIDING_WINDOW, AttentionSpec
from engine.interfaces.forward_context import ForwardContext
from engine.interfaces.model import Model, ModelInit
from engine.layers.attention import Attention
from engine.layers.decoder import GATE_UP_PARAMS, DecoderStack, load_tensor
from engine.layers.layernorm import RMSNorm
from engine.layers.linear import (
    ColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    gather_logits,
    linear_layers,
)
from engine.layers.rotary import RotaryEmbedding
from engine.model_config import HFConfig

# checkpoint module name -> (fused module name, shard index)
STACKED_PARAMS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2), **GATE_UP_PARAMS}

SLIDING, FULL = "sliding_attention", "full_attention"
# transformers' rope bases when a config names none: global layers, local layers
DEFAULT_ROPE_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}
TANH_GELU = ("gelu_pytorch_tanh", "gelu_tanh")
# transformers' Gemma3TextConfig defaults for the fields read here: the published multimodal
# checkpoints' text_config names only what differs (gemma-3-4b-it's: hidden_size,
# intermediate_size, num_hidden_layers, rope_scaling, sliding_window)
TEXT_CONFIG_DEFAULTS = dict(
    vocab_size=262_208,
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=26,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    hidden_activation="gelu_pytorch_tanh",
    max_position_embeddings=131_072,
    rms_norm_eps=1e-6,
    query_pre_attn_scalar=256,
    sliding_window=4096,
    attention_bias=False,
    tie_word_embeddings=True,
)


def with_text_defaults(config: HFConfig) -> HFConfig:
    """``config`` with ``TEXT_CONFIG_DEFAULTS`` for the fields it leaves out, as transformers reads it."""
    return HFConfig({**TEXT_CONFIG_DEFAULTS, **config.to_dict()})


def layer_types(config: HFConfig) -> tuple[str, ...]:
    """Each layer's attention, ``sliding_attention`` or ``full_attention``: ``layer_types`` as
    the config lists them, else every ``sliding_window_pattern``-th layer (default 6) global."""
    num_layers = int(config.num_hidden_layers)
    types = config.get("layer_types")
    if types is None:
        pattern = int(config.get("sliding_window_pattern", 6))
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    unknown = sorted(set(types) - {SLIDING, FULL})
    if unknown:
        raise ValueError(f"Gemma3ForCausalLM has {SLIDING} and {FULL} layers; config.json lists layer types {unknown}.")
    if len(types) != num_layers:
        raise ValueError(f"config.json lists {len(types)} layer_types for {num_layers} num_hidden_layers.")
    return tuple(types)


def rope_parameters_by_layer_type(config: HFConfig) -> dict[str, dict[str, Any]]:
    """Rope parameters (``rope_type``, ``rope_theta``, the scaling's fields) per layer type.

    transformers 5 writes ``rope_parameters`` as ``{"full_attention": {...}, "sliding_attention":
    {...}}``; older configs give the global layers' ``rope_theta`` and ``rope_scaling`` and the
    local layers' ``rope_local_base_freq`` (their rope is never scaled)."""
    rope = config.get("rope_parameters")
    rope = rope.to_dict() if rope is not None else {}
    if FULL in rope or SLIDING in rope:
        params = {kind: dict(rope.get(kind) or {}) for kind in (FULL, SLIDING)}
    else:
        scaling = config.get("rope_scaling")
        full = {**(scaling.to_dict() if scaling is not None else {}), **rope}
        params = {FULL: full, SLIDING: {"rope_theta": config.get("rope_local_base_freq")}}
        params[FULL].setdefault("rope_theta", config.get("rope_theta"))
    for kind, values in params.items():
        if values.get("rope_theta") is None:
            values["rope_theta"] = DEFAULT_ROPE_THETA[kind]
        values["rope_type"] = values.get("rope_type", values.get("type", "default"))
    return params


@dataclass(frozen=True)
class Dims:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_layers: int
    rms_norm_eps: float
    attention_bias: bool

    @classmethod
    def from_config(cls, config: HFConfig) -> Dims:
        activation = config.get("hidden_activation", config.get("hidden_act", "gelu_pytorch_tanh"))
        if activation not in TANH_GELU:
            raise ValueError(
                f"Gemma3ForCausalLM computes the tanh GELU (hidden_activation 'gelu_pytorch_tanh'); "
                f"config.json has {activation!r}."
            )
        if config.get("attn_logit_softcapping") is not None:
            raise ValueError(
                f"config.json sets attn_logit_softcapping {config.attn_logit_softcapping}, which Gemma 3 does not "
                f"use (transformers' Gemma3 ignores it); remove it from config.json or set it to null."
            )
        if config.get("use_bidirectional_attention", False):
            raise ValueError(
                "config.json sets use_bidirectional_attention (an embedding model's encoder); "
                "Gemma3ForCausalLM generates with causal attention only."
            )
        num_heads = int(config.num_attention_heads)
        return cls(
            hidden_size=int(config.hidden_size),
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads", num_heads)),
            head_dim=int(config.get("head_dim", config.hidden_size // num_heads)),
            intermediate_size=int(config.intermediate_size),
            vocab_size=int(config.vocab_size),
            num_layers=int(config.num_hidden_layers),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            attention_bias=bool(config.get("attention_bias", False)),
        )


class Gemma3Attention(nn.Module):
    def __init__(self, dims: Dims, spec: AttentionSpec, layer_index: int, dtype: torch.dtype, tp: TensorParallel):
        super().__init__()
        # this rank's heads (all of them without tensor parallelism)
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, dims.head_dim
        self.qkv_proj = QKVParallelLinear(
            dims.hidden_size, dims.num_heads, dims.num_kv_heads, dims.head_dim, dims.attention_bias, dtype, tp=tp
        )
        self.o_proj = RowParallelLinear(
            dims.num_heads * dims.head_dim,
            dims.hidden_size,
            dims.attention_bias,
            dtype,
            what="num_attention_heads × head_dim",
            tp=tp,
        )
        self.q_norm = RMSNorm(dims.head_dim, dims.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(dims.head_dim, dims.rms_norm_eps, dtype)
        self.attn = Attention(layer_index, spec)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj.forward(x).split(self.qkv_proj.output_sizes, dim=-1)
        # q: [T, H, D]; k, v: [T, Hkv, D]
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.q_norm.forward(q, ops=ctx.ops), self.k_norm.forward(k, ops=ctx.ops)
        q, k = ctx.ops.rotary(q, k, *cos_sin)
        out = self.attn(q, k, v, ctx)
        return self.o_proj.forward(out.reshape(num_tokens, self.num_heads * self.head_dim))


class Gemma3MLP(nn.Module):
    """``down(gelu_tanh(gate(x)) * up(x))``, split over the intermediate size under ``tp``."""

    def __init__(self, dims: Dims, dtype: torch.dtype, tp: TensorParallel) -> None:
        super().__init__()
        size = dims.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(
            dims.hidden_size, [size] * 2, False, dtype, what="intermediate_size", tp=tp
        )
        self.down_proj = RowParallelLinear(size, dims.hidden_size, False, dtype, what="intermediate_size", tp=tp)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        gate, up = self.gate_up_proj.forward(x).chunk(2, dim=-1)
        return self.down_proj.forward(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    """Attention and MLP each between two norms, on a residual stream::

        h = h + post_attention_layernorm(self_attn(input_layernorm(h)))
        h = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))

    As in ``PreNormDecoderLayer``, ``forward`` returns the MLP's normed output and the residual
    without it, so the next layer's input norm (or the final norm) fuses the add."""

    def __init__(self, self_attn: Gemma3Attention, mlp: Gemma3MLP, layer_type: str, dims: Dims, dtype: torch.dtype):
        super().__init__()
        self.layer_type = layer_type
        self.self_attn = self_attn
        self.mlp = mlp
        hidden, eps = dims.hidden_size, dims.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps, dtype)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, dtype)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, dtype)

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: ForwardContext,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, h = h, self.input_layernorm.forward(h, ops=ctx.ops)
        else:
            h, residual = self.input_layernorm.forward(h, residual, ops=ctx.ops)
        h = self.post_attention_layernorm.forward(self.self_attn.forward(h, ctx, cos_sin), ops=ctx.ops)
        h, residual = self.pre_feedforward_layernorm.forward(h, residual, ops=ctx.ops)
        return self.post_feedforward_layernorm.forward(self.mlp.forward(h, ctx), ops=ctx.ops), residual


class Gemma3Stack(DecoderStack):
    """The embedding scaled by ``sqrt(hidden_size)``, layers that each take their kind's rope table."""

    def forward(
        self,
        input_ids: torch.Tensor,
        ctx: ForwardContext,
        cos_sin: Callable[[torch.dtype], dict[str, tuple[torch.Tensor, torch.Tensor]]],
    ) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        # the scale rounded to the compute dtype first, as transformers does (sqrt(3072) is 55.5 in bf16)
        h = h * torch.tensor(h.shape[-1] ** 0.5, dtype=h.dtype)
        tables = cos_sin(h.dtype)
        residual = None
        for layer in self.layers:
            h, residual = layer.forward(h, residual, ctx, tables[layer.layer_type])
        h, _ = self.norm(h, residual, ops=ctx.ops)
        return h


class Gemma3ForCausalLM(Model):
    supports_tensor_parallel = True

    def __init__(self, init: ModelInit) -> None:
        super().__init__()
        config, dtype, tp = with_text_defaults(init.config), init.dtype, init.tp
        self.dims = dims = Dims.from_config(config)
        self.layer_types = layer_types(config)
        window = config.get("sliding_window")
        if SLIDING in self.layer_types and not window:
            raise ValueError("config.json lists sliding_attention layers but sets no sliding_window.")
        scale = float(config.get("query_pre_attn_scalar", dims.head_dim)) ** -0.5
        # this rank's heads
        num_heads = tp.split(dims.num_heads, "num_attention_heads")[1]
        num_kv_heads = tp.kv_heads(dims.num_kv_heads)[1]
        self.specs = [
            AttentionSpec(
                kind=SLIDING_WINDOW if kind == SLIDING else MHA,
                num_heads=num_heads,
                num_kv_heads=num_kv_heads,
                total_kv_heads=dims.num_kv_heads if tp.is_parallel else None,
                head_size=dims.head_dim,
                scale=scale,
                sliding_window=int(window) if kind == SLIDING else None,
            )
            for kind in self.layer_types
        ]
        final_softcap = config.get("final_logit_softcapping")
        self.final_logit_softcapping = float(final_softcap) if final_softcap is not None else None
        rope = rope_parameters_by_layer_type(config)
        max_positions = int(config.get("max_position_embeddings", 8192))
        with torch.device(init.device):
            layers = [
                Gemma3DecoderLayer(
                    Gemma3Attention(dims, self.specs[i], i, dtype, tp), Gemma3MLP(dims, dtype, tp), kind, dims, dtype
                )
                for i, kind in enumerate(self.layer_types)
            ]
            self.model = Gemma3Stack(dims.vocab_size, dims.hidden_size, dims.rms_norm_eps, layers, dtype, tp=tp)
            self.rotary = nn.ModuleDict(
                {kind: RotaryEmbedding(dims.head_dim, max_positions, rope[kind]) for kind in set(self.layer_types)}
            )
            self.tie_word_embeddings = bool(config.get("tie_word_embeddings", True))
            self.lm_head = ParallelLMHead(dims.hidden_size, dims.vocab_size, dtype, tp=tp)
            if self.tie_word_embeddings:
                self.lm_head.weight = self.model.embed_tokens.weight

    def kv_cache_specs(self) -> list[AttentionSpec]:
        return list(self.specs)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        # input_ids, positions: [T] -> hidden [T, hidden_size]
        return self.model(
            input_ids,
            ctx,
            lambda dtype: {kind: rotary.cos_sin(positions, dtype) for kind, rotary in self.rotary.items()},
        )

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = gather_logits(self.lm_head, hidden_states)
        cap = self.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params, linears = dict(self.named_parameters()), linear_layers(self)
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.startswith("lm_head.") and self.tie_word_embeddings:
                continue  # the embedding, stored twice
            if name.endswith("norm.weight"):
                # Gemma's norms scale by 1 + weight, the engine's RMSNorm by its weight
                tensor = tensor.float() + 1
            loaded |= load_tensor(self, params, linears, name, tensor, STACKED_PARAMS)
        return loaded
