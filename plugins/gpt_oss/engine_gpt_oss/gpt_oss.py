"""gpt-oss (``GptOssForCausalLM``), built from the engine's layers.

What sets it apart from Llama: attention sinks (a learned logit per query head that joins the
softmax's denominator and adds no value: ``AttentionSpec.sinks``, which the backend computes);
sliding-window and full attention layers alternating as ``layer_types`` lists them; biases on
q, k, v and o; YaRN rope; and a mixture of experts in every layer: a router with a bias picks
the top ``num_experts_per_tok`` experts by logit and weighs them by the softmax of those
logits, and every expert is a clamped SwiGLU with biases::

    gate, up = x W_gate + b_gate, x W_up + b_up       (interleaved columns of gate_up_proj)
    gate, up = min(gate, limit), clamp(up, -limit, limit)
    expert(x) = ((up + 1) · gate · sigmoid(alpha · gate)) W_down + b_down

The experts keep transformers' stacked layout (``gate_up_proj`` [E, hidden, 2I] with gate and
up in alternate columns, ``down_proj`` [E, I, hidden]). A checkpoint that ships them in MXFP4
(``quant_method: "mxfp4"``: ``X_blocks`` and ``X_scales``) keeps them in its values: each
expert's projection becomes a group-quantized weight (``engine.interfaces.group_quant.from_mxfp4``:
the e2m1 values doubled, 6-bit, a power-of-two scale per 32 inputs), computed with the platform's
``group_quant_linear`` (:class:`Mxfp4Quantizer`, registered as ``mxfp4``, has the engine pass
the blocks on with their scales instead of dequantizing them).

Under tensor parallelism each rank runs its attention heads (with their sinks) and its part of
every expert's intermediate size (a contiguous run of ``gate_up_proj``'s alternate columns, the
matching rows of ``down_proj``; the first rank adds the down bias); the router runs whole on
every rank, and the ranks sum their outputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import TensorParallel
from engine.interfaces.attention import MHA, SLIDING_WINDOW, AttentionSpec
from engine.interfaces.forward_context import ForwardContext
from engine.interfaces.group_quant import MXFP4_GROUP, GroupQuantWeight, from_mxfp4
from engine.interfaces.model import Model, ModelInit
from engine.interfaces.ops import LayerOps
from engine.interfaces.quantizer import ExpertsMethod, LinearMethod, Quantizer
from engine.layers.attention import Attention
from engine.layers.decoder import DecoderStack, PreNormDecoderLayer, load_tensor
from engine.layers.linear import (
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    gather_argmax,
    gather_logits,
    linear_layers,
    shard_parameter,
)
from engine.layers.quantized_checkpoint import quantized_checkpoint
from engine.layers.rotary import RotaryEmbedding, rope_parameters
from engine.model_config import HFConfig

# the stacked experts the checkpoint stream passes on in MXFP4, carrying their scales
MXFP4_EXPERTS = ("experts.gate_up_proj.weight", "experts.down_proj.weight")
# checkpoint module name -> (fused module name, shard index)
STACKED_PARAMS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}

SLIDING, FULL = "sliding_attention", "full_attention"
# transformers' rope when a config names none
DEFAULT_ROPE_THETA = 150000.0
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


def layer_types(config: HFConfig) -> tuple[str, ...]:
    """Each layer's attention: ``layer_types`` as the config lists them, else sliding and full alternating."""
    num_layers = int(config.num_hidden_layers)
    types = config.get("layer_types") or [SLIDING if (i + 1) % 2 else FULL for i in range(num_layers)]
    unknown = sorted(set(types) - {SLIDING, FULL})
    if unknown:
        raise ValueError(f"GptOssForCausalLM has {SLIDING} and {FULL} layers; config.json lists layer types {unknown}.")
    if len(types) != num_layers:
        raise ValueError(f"config.json lists {len(types)} layer_types for {num_layers} num_hidden_layers.")
    return tuple(types)


def gpt_oss_rope_parameters(config: HFConfig) -> dict[str, Any]:
    """The rope parameters, with transformers' gpt-oss defaults (YaRN, base 150000) where the config has none."""
    fields = [config.get(field) for field in ("rope_parameters", "rope_scaling")]
    if all(field is None for field in fields):
        return {**DEFAULT_ROPE, "rope_theta": float(config.get("rope_theta", DEFAULT_ROPE_THETA))}
    params = rope_parameters(config)
    thetas = [config.get("rope_theta")] + [field.get("rope_theta") for field in fields if field is not None]
    if all(theta is None for theta in thetas):
        params["rope_theta"] = DEFAULT_ROPE_THETA
    return params


@dataclass(frozen=True)
class Dims:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    num_experts: int
    experts_per_token: int
    vocab_size: int
    num_layers: int
    rms_norm_eps: float
    attention_bias: bool
    swiglu_alpha: float
    swiglu_limit: float

    @classmethod
    def from_config(cls, config: HFConfig) -> Dims:
        num_heads = int(config.num_attention_heads)
        dims = cls(
            hidden_size=int(config.hidden_size),
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads", num_heads)),
            head_dim=int(config.get("head_dim", config.hidden_size // num_heads)),
            intermediate_size=int(config.intermediate_size),
            num_experts=int(config.get("num_local_experts", config.get("num_experts", 0))),
            experts_per_token=int(config.get("num_experts_per_tok", 0)),
            vocab_size=int(config.vocab_size),
            num_layers=int(config.num_hidden_layers),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
            attention_bias=bool(config.get("attention_bias", True)),
            swiglu_alpha=float(config.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(config.get("swiglu_limit", 7.0)),
        )
        if not 0 < dims.experts_per_token <= dims.num_experts:
            raise ValueError(
                f"config.json routes each token to num_experts_per_tok={dims.experts_per_token} of "
                f"num_local_experts={dims.num_experts} experts; it must be at least 1 and at most the expert count."
            )
        return dims


class SinkAttention(Attention):
    """The attention layer with each query head's sink logit (``sinks`` [num_heads], float32;
    this rank's heads, from ``first_head`` of ``total_heads``)."""

    def __init__(self, layer_index: int, spec: AttentionSpec, first_head: int, total_heads: int) -> None:
        super().__init__(layer_index, spec)
        sinks = nn.Parameter(torch.empty(spec.num_heads, dtype=torch.float32), requires_grad=False)
        self.sinks = shard_parameter(sinks, 0, first_head, total_heads)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        # q: [T, H, D]; k, v: [T, Hkv, D] -> [T, H, D]
        return ctx.attention(self.layer_index, q, k, v, sinks=self.sinks)


class GptOssAttention(nn.Module):
    def __init__(
        self, dims: Dims, spec: AttentionSpec, layer_index: int, dtype: torch.dtype, tp: TensorParallel
    ) -> None:
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
        first_head = tp.split(dims.num_heads, "num_attention_heads")[0]
        self.attn = SinkAttention(layer_index, spec, first_head, dims.num_heads)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj.forward(x).split(self.qkv_proj.output_sizes, dim=-1)
        # q: [T, H, D]; k, v: [T, Hkv, D]
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = ctx.ops.rotary(q, k, *cos_sin)
        out = self.attn(q, k, v, ctx)
        return self.o_proj.forward(out.reshape(num_tokens, self.num_heads * self.head_dim))


class Router(nn.Module):
    """Logits ``x Wᵀ + b`` in the compute dtype (as transformers computes them), the top
    ``experts_per_token`` experts by logit, weighted by the softmax of their logits."""

    def __init__(self, dims: Dims, dtype: torch.dtype) -> None:
        super().__init__()
        self.experts_per_token = dims.experts_per_token
        self.weight = nn.Parameter(torch.empty(dims.num_experts, dims.hidden_size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(dims.num_experts, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden] -> (expert ids [T, k], weights [T, k] in x's dtype)."""
        logits = F.linear(x, self.weight, self.bias)  # [T, E]
        top_logits, expert_ids = logits.topk(self.experts_per_token, dim=-1)
        return expert_ids, top_logits.softmax(dim=-1)


class Experts(nn.Module):
    """The experts in transformers' stacked layout; tokens sorted by expert, one pair of
    matmuls per active expert over all of its tokens. Under ``tp`` each rank holds its part of
    the intermediate size of every expert."""

    def __init__(self, dims: Dims, dtype: torch.dtype, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        start, i = tp.split(dims.intermediate_size, "intermediate_size")  # this rank's part
        e, h, full = dims.num_experts, dims.hidden_size, dims.intermediate_size

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        # gate and up alternate, so this rank's columns of both are one run: 2·start .. 2·(start + i)
        self.gate_up_proj = shard_parameter(param(e, h, 2 * i), 2, 2 * start, 2 * full)
        self.gate_up_proj_bias = shard_parameter(param(e, 2 * i), 1, 2 * start, 2 * full)
        self.down_proj = shard_parameter(param(e, i, h), 1, start, full)
        self.down_proj_bias = param(e, h)
        self.alpha, self.limit = dims.swiglu_alpha, dims.swiglu_limit
        self.num_experts, self.hidden_size, self.intermediate_size = e, h, i
        # projections kept in MXFP4's values (load_mxfp4): one weight per expert, by projection
        self.quantized: dict[str, list[GroupQuantWeight]] = {}

    def load_mxfp4(self, proj: str, blocks: torch.Tensor, scales: torch.Tensor, what: str) -> list[str]:
        """A stacked projection kept in MXFP4 (``blocks`` uint8 [E, out, in / 32, 16], ``scales``
        uint8 [E, out, in / 32]) in place of its dense stack: each expert's rows as a
        group-quantized weight. Returns the names of the parameters that now hold it."""
        if self.tp.is_parallel:
            raise ValueError(
                f"{what}: MXFP4 experts cannot be split across {self.tp.size} tensor-parallel ranks yet; "
                "use --tensor-parallel-size 1."
            )
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        outputs, inputs = (2 * i, h) if proj == "gate_up_proj" else (h, i)
        groups = inputs // MXFP4_GROUP
        shapes = (e, outputs, groups, 16), (e, outputs, groups)
        if inputs % MXFP4_GROUP or (tuple(blocks.shape), tuple(scales.shape)) != shapes:
            raise ValueError(
                f"{what}: MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)}; the model's "
                f"{e} experts of {outputs} outputs and {inputs} inputs take {shapes[0]} and {shapes[1]}."
            )
        before = set(self._parameters)
        delattr(self, proj)  # the dense stack
        try:
            self.quantized[proj] = [
                from_mxfp4(blocks[x].flatten(-2), scales[x]).attach(self, f"_{proj}_{x}") for x in range(e)
            ]
        except ValueError as error:
            raise ValueError(f"{what}: {error}.") from None
        return sorted(set(self._parameters) - before)

    def _project(self, proj: str, expert: int, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        """x @ W of one expert's projection, from its MXFP4 values or its dense stack."""
        weights = self.quantized.get(proj)
        if weights is not None:
            return ops.group_quant_linear(x, weights[expert])
        return x @ getattr(self, proj)[expert]

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[n, 2I], gate and up in alternate columns -> the clamped SwiGLU [n, I]."""
        gate = gate_up[:, ::2].clamp(max=self.limit)
        up = gate_up[:, 1::2].clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        """x [T, hidden], expert_ids / weights [T, k] -> Σ_k weight · expert(x) [T, hidden]."""
        num_tokens, k = expert_ids.shape
        flat = expert_ids.flatten()
        order = flat.argsort(stable=True)  # (token, choice) rows in expert order
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        # each (token, choice)'s expert output, in place: [T * k, hidden]
        outputs = torch.empty(num_tokens * k, x.shape[1], dtype=x.dtype, device=x.device)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = order[start : start + count]
            start += count
            gate_up = self._project("gate_up_proj", expert, x[rows // k], ops) + self.gate_up_proj_bias[expert]
            down = self._project("down_proj", expert, self.activation(gate_up), ops)
            outputs[rows] = down + self.down_proj_bias[expert] if self.tp.rank == 0 else down  # one bias in the sum
        weighted = outputs.view(num_tokens, k, -1).float() * weights.float().unsqueeze(-1)
        return self.tp.all_reduce(weighted.sum(dim=1)).to(x.dtype)


class GptOssMoE(nn.Module):
    def __init__(self, dims: Dims, dtype: torch.dtype, tp: TensorParallel) -> None:
        super().__init__()
        self.router = Router(dims, dtype)  # whole on every rank: every rank routes alike
        self.experts = Experts(dims, dtype, tp)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        expert_ids, weights = self.router(x)
        return self.experts(x, expert_ids, weights, ctx.ops)


class GptOssForCausalLM(Model):
    supports_tensor_parallel = True

    def __init__(self, init: ModelInit) -> None:
        super().__init__()
        config, dtype, tp = init.config, init.dtype, init.tp
        self.dims = dims = Dims.from_config(config)
        self.layer_types = layer_types(config)
        window = config.get("sliding_window")
        if SLIDING in self.layer_types and not window:
            raise ValueError("config.json lists sliding_attention layers but sets no sliding_window.")
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
                scale=dims.head_dim**-0.5,
                sliding_window=int(window) if kind == SLIDING else None,
                sinks=True,
            )
            for kind in self.layer_types
        ]
        with torch.device(init.device):
            layers = [
                PreNormDecoderLayer(
                    GptOssAttention(dims, spec, i, dtype, tp),
                    GptOssMoE(dims, dtype, tp),
                    dims.hidden_size,
                    dims.rms_norm_eps,
                    dtype,
                )
                for i, spec in enumerate(self.specs)
            ]
            self.model = DecoderStack(dims.vocab_size, dims.hidden_size, dims.rms_norm_eps, layers, dtype, tp=tp)
            self.rotary = RotaryEmbedding(
                dims.head_dim, int(config.get("max_position_embeddings", 131072)), gpt_oss_rope_parameters(config)
            )
            self.tie_word_embeddings = bool(config.get("tie_word_embeddings", False))
            self.lm_head = ParallelLMHead(dims.hidden_size, dims.vocab_size, dtype, tp=tp)
            if self.tie_word_embeddings:
                self.lm_head.weight = self.model.embed_tokens.weight

    def kv_cache_specs(self) -> list[AttentionSpec]:
        return list(self.specs)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        # input_ids, positions: [T] -> hidden [T, hidden_size]
        return self.model(input_ids, ctx, lambda dtype: self.rotary.cos_sin(positions, dtype))

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return gather_logits(self.lm_head, hidden_states)

    def compute_greedy_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return gather_argmax(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params, linears = dict(self.named_parameters()), linear_layers(self)
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.startswith("lm_head.") and self.tie_word_embeddings:
                continue  # the embedding, stored twice
            kept = quantized_checkpoint(tensor)
            if kept is not None and name.endswith(MXFP4_EXPERTS):  # kept in MXFP4 (Mxfp4Quantizer)
                path, proj = name.removesuffix(".weight").rsplit(".", 1)
                experts = self.get_submodule(path)
                loaded |= {f"{path}.{p}" for p in experts.load_mxfp4(proj, tensor, kept.scale, kept.name)}
                continue
            if name.endswith(".self_attn.sinks"):
                name = name.removesuffix("sinks") + "attn.sinks"  # held by the attention layer that passes them
            loaded |= load_tensor(self, params, linears, name, tensor, STACKED_PARAMS)
        return loaded


class Mxfp4Quantizer(Quantizer):
    """gpt-oss's ``quant_method: "mxfp4"``: the routed experts stay in their MXFP4 values
    (:meth:`Experts.load_mxfp4`); every other layer holds what the checkpoint holds (the
    attention layers ship in bf16). Prequantized checkpoints only."""

    name: ClassVar[str] = "mxfp4"
    activation_dtypes: ClassVar[frozenset[str]] = frozenset({"bfloat16", "float16", "float32"})

    @classmethod
    def from_config(cls, quantization_config: dict[str, Any], *, prequantized: bool) -> Mxfp4Quantizer:
        if not prequantized:
            raise ValueError(
                "--quantization mxfp4 names gpt-oss's checkpoint format, which the engine loads as the checkpoint "
                "ships it; it does not round a model while loading (compressed-tensors/mxfp4-pack-quantized does)."
            )
        return cls()

    def get_linear_method(self, layer_name: str) -> LinearMethod | None:
        return None  # the checkpoint's linear layers are not MXFP4

    def get_experts_method(self, layer_name: str) -> ExpertsMethod | None:
        return None  # gpt-oss holds its experts itself (Experts.load_mxfp4)
