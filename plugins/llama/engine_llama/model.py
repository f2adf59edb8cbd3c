"""The Llama family: one network, with per-architecture differences as data."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Iterable

import torch
from torch import nn

from engine.distributed import TensorParallel
from engine.interfaces.attention import MHA, SLIDING_WINDOW, AttentionSpec
from engine.interfaces.forward_context import ForwardContext
from engine.interfaces.model import Model, ModelInit
from engine.layers.attention import Attention
from engine.layers.decoder import (
    GATE_UP_PARAMS,
    DecoderStack,
    GatedMLP,
    PreNormDecoderLayer,
    load_tensor,
    require_silu,
)
from engine.layers.layernorm import RMSNorm
from engine.layers.linear import (
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    gather_argmax,
    gather_logits,
    linear_layers,
)
from engine.layers.rotary import RotaryEmbedding, rope_parameters
from engine.model_config import HFConfig

# checkpoint module name -> (fused module name, shard index)
STACKED_PARAMS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2), **GATE_UP_PARAMS}


@dataclass(frozen=True)
class Variant:
    """How an architecture departs from Llama."""

    qkv_bias: bool | None = None  # None: config.attention_bias
    o_bias: bool | None = None  # None: config.attention_bias
    qk_norm: bool = False
    # "none"; "all" (Mistral); "use_sliding_window": all, when the config's flag says so (Qwen3-MoE);
    # "layer_types": per layer_types or max_window_layers, when the flag says so (Qwen2/Qwen3)
    sliding_window: str = "none"


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

    @classmethod
    def from_config(cls, config: HFConfig) -> Dims:
        num_heads = config.num_attention_heads
        return cls(
            hidden_size=config.hidden_size,
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads", num_heads),
            head_dim=config.get("head_dim", config.hidden_size // num_heads),
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            num_layers=config.num_hidden_layers,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        )


class LlamaAttentionBlock(nn.Module):
    def __init__(
        self,
        dims: Dims,
        spec: AttentionSpec,
        layer_index: int,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        dtype: torch.dtype,
        tp: TensorParallel,
    ) -> None:
        super().__init__()
        # this rank's heads (all of them without tensor parallelism)
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, dims.head_dim
        self.qkv_proj = QKVParallelLinear(
            dims.hidden_size, dims.num_heads, dims.num_kv_heads, dims.head_dim, qkv_bias, dtype, tp=tp
        )
        self.o_proj = RowParallelLinear(
            dims.num_heads * dims.head_dim,
            dims.hidden_size,
            o_bias,
            dtype,
            what="num_attention_heads × head_dim",
            tp=tp,
        )
        if qk_norm:
            self.q_norm = RMSNorm(dims.head_dim, dims.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(dims.head_dim, dims.rms_norm_eps, dtype)
        self.qk_norm = qk_norm
        self.attn = Attention(layer_index, spec)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        num_tokens, num_heads, num_kv_heads = x.shape[0], self.num_heads, self.num_kv_heads
        # q: [T, H, D]; k, v: [T, Hkv, D], views of the fused projection's output
        qkv = self.qkv_proj.forward(x).view(num_tokens, num_heads + 2 * num_kv_heads, self.head_dim)
        q, k, v = qkv.split_with_sizes((num_heads, num_kv_heads, num_kv_heads), dim=1)
        if self.qk_norm:
            q, k = self.q_norm(q, ops=ctx.ops), self.k_norm(k, ops=ctx.ops)
        q, k = ctx.ops.rotary(q, k, *cos_sin)
        out = self.attn(q, k, v, ctx)
        return self.o_proj.forward(out.reshape(num_tokens, self.num_heads * self.head_dim))


class LlamaForCausalLM(Model):
    variant: ClassVar[Variant] = Variant()
    tool_parser = "llama3_json"
    supports_tensor_parallel = True

    def __init__(self, init: ModelInit) -> None:
        super().__init__()
        config, dtype, tp = init.config, init.dtype, init.tp
        require_silu(config, self)
        self.dims = dims = Dims.from_config(config)
        variant = self.variant
        attention_bias = bool(config.get("attention_bias", False))
        qkv_bias = attention_bias if variant.qkv_bias is None else variant.qkv_bias
        o_bias = attention_bias if variant.o_bias is None else variant.o_bias
        self.specs = self._attention_specs(config, dims, tp)
        with torch.device(init.device):
            layers = [
                PreNormDecoderLayer(
                    LlamaAttentionBlock(dims, self.specs[i], i, qkv_bias, o_bias, variant.qk_norm, dtype, tp),
                    self.make_mlp(config, dims, i, dtype, tp),
                    dims.hidden_size,
                    dims.rms_norm_eps,
                    dtype,
                )
                for i in range(dims.num_layers)
            ]
            self.model = DecoderStack(dims.vocab_size, dims.hidden_size, dims.rms_norm_eps, layers, dtype, tp=tp)
            rope = self.rope_parameters(config)
            partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
            self.rotary = RotaryEmbedding(
                dims.head_dim,
                int(config.get("max_position_embeddings", 2048)),
                rope,
                rotary_dim=int(dims.head_dim * float(partial)),
            )
            self.tie_word_embeddings = bool(config.get("tie_word_embeddings", False))
            self.lm_head = ParallelLMHead(dims.hidden_size, dims.vocab_size, dtype, tp=tp)
            if self.tie_word_embeddings:
                self.lm_head.weight = self.model.embed_tokens.weight

    def make_mlp(self, config: HFConfig, dims: Dims, index: int, dtype: torch.dtype, tp: TensorParallel) -> nn.Module:
        """Layer ``index``'s MLP, called as ``mlp(h, ctx)``: a gated SiLU MLP of ``intermediate_size``."""
        return GatedMLP(dims.hidden_size, dims.intermediate_size, bool(config.get("mlp_bias", False)), dtype, tp=tp)

    def rope_parameters(self, config: HFConfig) -> dict[str, Any]:
        """The config's rope parameters, normalised (:func:`engine.layers.rotary.rope_parameters`)."""
        return rope_parameters(config)

    def _attention_specs(self, config: HFConfig, dims: Dims, tp: TensorParallel) -> list[AttentionSpec]:
        windows: list[int | None] = [None] * dims.num_layers
        window = config.get("sliding_window")
        if self.variant.sliding_window == "all" and window:
            windows = [int(window)] * dims.num_layers
        elif self.variant.sliding_window == "use_sliding_window" and window and config.get("use_sliding_window", False):
            windows = [int(window)] * dims.num_layers
        elif self.variant.sliding_window == "layer_types" and window and config.get("use_sliding_window", False):
            layer_types = config.get("layer_types") or [
                "sliding_attention" if i >= config.get("max_window_layers", 0) else "full_attention"
                for i in range(dims.num_layers)
            ]
            windows = [int(window) if t == "sliding_attention" else None for t in layer_types]
        scale = dims.head_dim**-0.5
        # this rank's heads
        num_heads = tp.split(dims.num_heads, "num_attention_heads")[1]
        num_kv_heads = tp.kv_heads(dims.num_kv_heads)[1]
        return [
            AttentionSpec(
                kind=SLIDING_WINDOW if w else MHA,
                num_heads=num_heads,
                num_kv_heads=num_kv_heads,
                total_kv_heads=dims.num_kv_heads if tp.is_parallel else None,
                head_size=dims.head_dim,
                scale=scale,
                sliding_window=w,
            )
            for w in windows
        ]

    def kv_cache_specs(self) -> list[AttentionSpec]:
        return list(self.specs)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        # input_ids, positions: [T] -> hidden [T, hidden_size]
        return self.model.forward(input_ids, ctx, lambda dtype: self.rotary.cos_sin(positions, dtype))

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return gather_logits(self.lm_head, hidden_states)

    def compute_greedy_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return gather_argmax(self.lm_head, hidden_states)

    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors as this model names them, those it does not use left out."""
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name.startswith("lm_head.") and self.tie_word_embeddings:
                continue  # some tied checkpoints also store the shared matrix under lm_head
            yield name, tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params, linears = dict(self.named_parameters()), linear_layers(self)
        loaded: set[str] = set()
        for name, tensor in self.checkpoint_tensors(weights):
            loaded |= load_tensor(self, params, linears, name, tensor, STACKED_PARAMS)
        return loaded


class MistralForCausalLM(LlamaForCausalLM):
    variant = Variant(qkv_bias=False, o_bias=False, sliding_window="all")
    tool_parser = "mistral"


class Qwen2ForCausalLM(LlamaForCausalLM):
    variant = Variant(qkv_bias=True, o_bias=False, sliding_window="layer_types")
    tool_parser = "hermes"


class Qwen3ForCausalLM(LlamaForCausalLM):
    variant = Variant(qk_norm=True, sliding_window="layer_types")
    tool_parser = "hermes"
    reasoning_parser = "qwen3"
