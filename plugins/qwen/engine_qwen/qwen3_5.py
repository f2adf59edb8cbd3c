"""Qwen3.5 (``Qwen3_5ForCausalLM``): gated DeltaNet layers with a gated full-attention layer
every few (``layer_types``), SwiGLU MLPs.

- **Gated DeltaNet** (``linear_attention`` layers).
  - ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b`` and ``in_proj_a`` are one fused projection
    here. q, k ([``linear_num_key_heads``, ``linear_key_head_dim``]) and v
    ([``linear_num_value_heads``, ``linear_value_head_dim``]) pass a causal depthwise
    convolution (``conv1d``, no bias) with SiLU; q and k are L2-normalised per head, q scaled
    by ``linear_key_head_dim^-½``.
  - The decay is one per head: ``g = -exp(A_log) · softplus(a + dt_bias)``; ``β = σ(b)``.
  - The recurrence is the gated delta rule, ``S = (I - β k kᵀ) · exp(g) · S + β k vᵀ``, the
    Kimi delta rule with one decay for all of a head's channels: it runs on the platform's
    ``linear`` backend (``forward_linear``) with g broadcast over the channels. Each key head
    serves ``linear_num_value_heads / linear_num_key_heads`` consecutive value heads: q and k
    (with their convolution channels) are repeated to the value heads before the backend.
  - The output is RMS-normalised per value head (float32, weight ``norm``), times
    ``silu(z)``, then ``out_proj``.
- **Gated attention** (``full_attention`` layers): ``q_proj`` gives each head's query and an
  output gate side by side ([H, 2 · head_dim]); q and k are RMS-normalised per head
  (zero-centred weights), RoPE turns the first ``partial_rotary_factor`` of each head (for
  text, transformers' multimodal RoPE sections all read the same position), and the
  attention output is multiplied by ``σ(gate)`` before ``o_proj``.
- **Norms** are zero-centred (``x̂ · (1 + w)`` in float32) everywhere but the DeltaNet's output
  norm.

``Qwen3_5MoeForCausalLM`` replaces every MLP with routed experts (softmax top-k, renormalised,
in float32) and one shared expert scaled by ``σ(shared_expert_gate(x))``.

``Qwen3NextForCausalLM`` (Qwen3-Next) is Qwen3.5-MoE with experts on the layers
``decoder_sparse_step`` / ``mlp_only_layers`` choose and its DeltaNet projections fused per key
head in the checkpoint (regrouped at load).

Checkpoints of ``Qwen3_5ForCausalLM`` name the text model ``model.*``. The published Qwen3.5
checkpoints are the multimodal ``Qwen3_5ForConditionalGeneration`` /
``Qwen3_5MoeForConditionalGeneration``: their text model (config under ``text_config``,
weights under ``model.language_model.``) is served, the vision tower (``model.visual.``) is
skipped, so they take text prompts only.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import TensorParallel
from engine.interfaces.attention import LINEAR, MHA, AttentionSpec
from engine.interfaces.forward_context import ForwardContext
from engine.interfaces.model import Model, ModelInit
from engine.layers.attention import Attention
from engine.layers.decoder import GATE_UP_PARAMS, GatedMLP, require_silu
from engine.layers.linear import (
    ColumnParallelLinear,
    Linear,
    MergedLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabEmbedding,
    gather_argmax,
    gather_logits,
    shard_parameter,
)
from engine.layers.moe import Experts, SoftmaxRouter, load_named_tensors
from engine.layers.rotary import RotaryEmbedding, rope_parameters
from engine.model_config import HFConfig

logger = logging.getLogger("engine.qwen")

STACKED = {
    **GATE_UP_PARAMS,
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "in_proj_q": ("in_proj", 0),  # the checkpoints' in_proj_qkv, cut in three at load
    "in_proj_k": ("in_proj", 1),
    "in_proj_v": ("in_proj", 2),
    "in_proj_z": ("in_proj", 3),
    "in_proj_b": ("in_proj", 4),
    "in_proj_a": ("in_proj", 5),
}


@dataclass(frozen=True)
class Dims:
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int
    layer_types: tuple[str, ...]
    eps: float
    max_positions: int

    @classmethod
    def from_config(cls, config: HFConfig) -> Dims:
        num_heads = config.num_attention_heads
        head_dim = config.get("head_dim") or config.hidden_size // num_heads
        rope = rope_parameters(config)
        factor = float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))
        layers = config.num_hidden_layers
        interval = int(config.get("full_attention_interval", 4))
        layer_types = tuple(
            config.get("layer_types")
            or ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
        )
        unknown = sorted(set(layer_types) - {"full_attention", "linear_attention"})
        if unknown or len(layer_types) != layers:
            raise ValueError(
                f"Qwen3.5 layer_types must name {layers} full_attention / linear_attention layers, got {layer_types}."
            )
        key_heads, value_heads = config.linear_num_key_heads, config.linear_num_value_heads
        if value_heads % key_heads:
            raise ValueError(
                f"linear_num_value_heads ({value_heads}) must be a multiple of linear_num_key_heads ({key_heads})."
            )
        return cls(
            hidden_size=config.hidden_size,
            intermediate_size=config.get("intermediate_size", 0),  # the MoE model has none
            vocab_size=config.vocab_size,
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads", num_heads),
            head_dim=head_dim,
            rotary_dim=int(head_dim * factor),
            key_heads=key_heads,
            value_heads=value_heads,
            key_dim=config.linear_key_head_dim,
            value_dim=config.linear_value_head_dim,
            conv_kernel=config.get("linear_conv_kernel_dim", 4),
            layer_types=layer_types,
            eps=config.get("rms_norm_eps", 1e-6),
            max_positions=int(config.get("max_position_embeddings", 4096)),
        )


class ZeroCenteredRMSNorm(nn.Module):
    """``x̂ · (1 + w)`` in float32, rounded to x's dtype (checkpoints hold ``w``, initialised at 0)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """The DeltaNet's output norm: RMS over each head's values in float32, rounded, times the
    weight, times ``silu(gate)`` in float32."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return ((self.weight * normed) * F.silu(gate.float())).to(x.dtype)


def sharded(shape: tuple[int, ...], dtype: torch.dtype, first: int, full: int) -> nn.Parameter:
    """A parameter holding this rank's ``shape[0]`` of ``full`` rows of a checkpoint tensor, from ``first``."""
    return shard_parameter(nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False), 0, first, full)


class GatedDeltaNet(nn.Module):
    """Under tensor parallelism each rank runs its key heads and the value heads they serve:
    the projections, convolution channels, decays and states split by head, ``out_proj``
    summed over the ranks."""

    def __init__(self, d: Dims, layer_index: int, dtype: torch.dtype, tp: TensorParallel) -> None:
        super().__init__()
        self.d, self.layer_index = d, layer_index
        first_key, self.key_heads = tp.split(d.key_heads, "linear_num_key_heads")
        first_value, self.value_heads = tp.split(d.value_heads, "linear_num_value_heads")
        key_width, value_width = d.key_heads * d.key_dim, d.value_heads * d.value_dim
        what = "linear attention heads"
        # q, k, v, z, b, a: each split by head over the ranks
        sizes = [key_width, key_width, value_width, value_width, d.value_heads, d.value_heads]
        self.in_proj = ColumnParallelLinear(d.hidden_size, sizes, False, dtype, what, tp=tp)
        kernel = d.conv_kernel
        local_key, local_value = self.key_heads * d.key_dim, self.value_heads * d.value_dim
        self.q_conv = sharded((local_key, 1, kernel), dtype, first_key * d.key_dim, key_width)
        self.k_conv = sharded((local_key, 1, kernel), dtype, first_key * d.key_dim, key_width)
        self.v_conv = sharded((local_value, 1, kernel), dtype, first_value * d.value_dim, value_width)
        self.dt_bias = sharded((self.value_heads,), dtype, first_value, d.value_heads)
        self.A_log = sharded((self.value_heads,), dtype, first_value, d.value_heads)
        self.norm = GatedRMSNorm(d.value_dim, d.eps, dtype)
        self.out_proj = RowParallelLinear(value_width, d.hidden_size, False, dtype, what, tp=tp)
        self.repeat = d.value_heads // d.key_heads
        self.conv: torch.Tensor | None = None  # the convolution as the backend takes it (after loading)

    def weights_loaded(self) -> None:
        """Build the q, k (repeated for the value heads they serve) and v channels' convolution
        as the backend takes it, [channels, kernel], once the checkpoint is in."""
        q_conv, k_conv = self.q_conv.squeeze(1), self.k_conv.squeeze(1)
        if self.repeat > 1:
            q_conv, k_conv = (
                repeat_heads(w.t(), self.key_heads, self.d.key_dim, self.repeat).t() for w in (q_conv, k_conv)
            )
        self.conv = torch.cat([q_conv, k_conv, self.v_conv.squeeze(1)])

    def forward(self, x: torch.Tensor, ctx: ForwardContext, cos_sin=None) -> torch.Tensor:
        d, hk, hv = self.d, self.key_heads, self.value_heads
        q, k, v, z, b, a = self.in_proj(x).split(self.in_proj.output_sizes, -1)
        beta = torch.sigmoid(b).float()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # [T, value heads]
        g = g.unsqueeze(-1).expand(-1, -1, d.key_dim).contiguous()  # one decay for all of a head's channels
        if self.repeat > 1:  # each key head serves `repeat` consecutive value heads
            q, k = (repeat_heads(t, hk, d.key_dim, self.repeat) for t in (q, k))
        qkv = torch.cat([q, k, v], dim=-1)
        if self.conv is None:
            raise RuntimeError("GatedDeltaNet ran before its model's load_weights built its convolution.")
        out = ctx.linear(self.layer_index, qkv, self.conv, g, beta)  # [T, value heads, value dim]
        out = self.norm(out, z.reshape(-1, hv, d.value_dim))
        return self.out_proj(out.reshape(x.shape[0], hv * d.value_dim))


def repeat_heads(t: torch.Tensor, heads: int, head_dim: int, repeat: int) -> torch.Tensor:
    """[N, heads · head_dim] -> [N, heads · repeat · head_dim]: each head repeated ``repeat``
    times in place (key head ``h`` serves value heads ``h · repeat ..``, as transformers'
    ``repeat_interleave``)."""
    n = t.shape[0]
    return t.reshape(n, heads, head_dim).repeat_interleave(repeat, dim=1).reshape(n, -1)


def gated_qkv(d: Dims, dtype: torch.dtype, tp: TensorParallel) -> MergedLinear:
    """q (with each head's output gate beside it: [H, 2 · head_dim]), k and v fused; under
    tensor parallelism this rank's query heads and KV heads (replicated when fewer than ranks)."""
    full = [2 * d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim, d.num_kv_heads * d.head_dim]
    if not tp.is_parallel:
        return MergedLinear(d.hidden_size, full, False, dtype, tp=tp)
    q_start, q_count = tp.split(d.num_heads, "num_attention_heads")
    kv_start, kv_count = tp.kv_heads(d.num_kv_heads)
    kv = (kv_start * d.head_dim, kv_count * d.head_dim)
    slices = [(q_start * 2 * d.head_dim, q_count * 2 * d.head_dim), kv, kv]
    return MergedLinear(
        d.hidden_size, [n for _, n in slices], False, dtype, out_slices=slices, full_output_sizes=full, tp=tp
    )


class GatedAttention(nn.Module):
    def __init__(self, d: Dims, spec: AttentionSpec, layer_index: int, dtype: torch.dtype, tp: TensorParallel) -> None:
        super().__init__()
        self.d, self.heads, self.kv_heads = d, spec.num_heads, spec.num_kv_heads
        self.qkv_proj = gated_qkv(d, dtype, tp)
        self.q_norm = ZeroCenteredRMSNorm(d.head_dim, d.eps, dtype)
        self.k_norm = ZeroCenteredRMSNorm(d.head_dim, d.eps, dtype)
        self.o_proj = RowParallelLinear(
            d.num_heads * d.head_dim, d.hidden_size, False, dtype, "num_attention_heads × head_dim", tp=tp
        )
        self.attn = Attention(layer_index, spec)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, cos_sin) -> torch.Tensor:
        d, n = self.d, x.shape[0]
        qg, k, v = self.qkv_proj(x).split(self.qkv_proj.output_sizes, dim=-1)
        qg = qg.view(n, self.heads, 2 * d.head_dim)
        q, gate = qg[..., : d.head_dim], qg[..., d.head_dim :].reshape(n, -1)
        q = self.q_norm(q)
        k = self.k_norm(k.reshape(n, self.kv_heads, d.head_dim))
        q, k = ctx.ops.rotary(q.contiguous(), k.contiguous(), *cos_sin)
        out = self.attn(q, k, v.reshape(n, self.kv_heads, d.head_dim).contiguous(), ctx)
        return self.o_proj(out.reshape(n, -1) * torch.sigmoid(gate))


class SparseMoE(nn.Module):
    """Routed experts plus one shared expert scaled by ``σ(shared_expert_gate(x))``."""

    def __init__(self, config: HFConfig, hidden_size: int, dtype: torch.dtype, tp) -> None:
        super().__init__()
        experts = config.num_experts
        normalize = bool(config.get("norm_topk_prob", True))
        self.gate = SoftmaxRouter(experts, hidden_size, config.num_experts_per_tok, normalize, dtype)
        self.experts = Experts(experts, config.moe_intermediate_size, hidden_size, dtype, tp=tp)
        self.shared_expert = GatedMLP(hidden_size, config.shared_expert_intermediate_size, False, dtype, tp=tp)
        self.shared_expert_gate = Linear(hidden_size, 1, False, dtype)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        expert_ids, weights = self.gate(x)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, ctx)
        return self.experts(x, expert_ids, weights, ctx) + shared


class DecoderLayer(nn.Module):
    def __init__(self, mixer: nn.Module, mlp: nn.Module, d: Dims, dtype: torch.dtype) -> None:
        super().__init__()
        self.mixer = mixer
        self.mlp = mlp
        self.input_layernorm = ZeroCenteredRMSNorm(d.hidden_size, d.eps, dtype)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(d.hidden_size, d.eps, dtype)

    def forward(self, h: torch.Tensor, ctx: ForwardContext, cos_sin) -> torch.Tensor:
        h = h + self.mixer(self.input_layernorm(h), ctx, cos_sin)
        return h + self.mlp(self.post_attention_layernorm(h), ctx)


class Qwen3_5ForCausalLM(Model):
    supports_tensor_parallel = True
    tool_parser = "qwen3_coder"  # <tool_call><function=...><parameter=...> (engine_qwen.parsers)
    reasoning_parser = "qwen3"  # <think> ... </think>, engine-llama's

    def __init__(self, init: ModelInit) -> None:
        super().__init__()
        config, dtype, tp = init.config, init.dtype, init.tp
        require_silu(config, self)
        d = self.dims = Dims.from_config(config)
        # the specs count this rank's heads
        heads = tp.split(d.num_heads, "num_attention_heads")[1]
        value_heads = tp.split(d.value_heads, "linear_num_value_heads")[1]
        self.attention_spec = AttentionSpec(
            MHA,
            heads,
            tp.kv_heads(d.num_kv_heads)[1],
            d.head_dim,
            d.head_dim**-0.5,
            total_kv_heads=d.num_kv_heads if tp.is_parallel else None,
        )
        self.delta_spec = AttentionSpec(
            LINEAR,
            value_heads,
            value_heads,
            d.key_dim,
            d.key_dim**-0.5,
            value_size=d.value_dim,
            conv_kernel=d.conv_kernel,
            total_num_heads=d.value_heads if tp.is_parallel else None,
        )
        with torch.device(init.device):
            layers = []
            for i, kind in enumerate(d.layer_types):
                mixer = (
                    GatedAttention(d, self.attention_spec, i, dtype, tp)
                    if kind == "full_attention"
                    else GatedDeltaNet(d, i, dtype, tp)
                )
                layers.append(DecoderLayer(mixer, self.make_mlp(config, d, i, dtype, tp), d, dtype))
            self.model = nn.Module()
            self.model.embed_tokens = VocabEmbedding(d.vocab_size, d.hidden_size, dtype, tp=tp)
            self.model.layers = nn.ModuleList(layers)
            self.model.norm = ZeroCenteredRMSNorm(d.hidden_size, d.eps, dtype)
            self.rotary = RotaryEmbedding(d.head_dim, d.max_positions, rope_parameters(config), rotary_dim=d.rotary_dim)
            self.tie_word_embeddings = bool(config.get("tie_word_embeddings", False))
            self.lm_head = ParallelLMHead(d.hidden_size, d.vocab_size, dtype, tp=tp)
            if self.tie_word_embeddings:
                self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def make_mlp(cls, config: HFConfig, d: Dims, index: int, dtype: torch.dtype, tp) -> nn.Module:
        """Layer ``index``'s MLP (the multi-token-prediction block's layers count from 0 too)."""
        return GatedMLP(d.hidden_size, d.intermediate_size, False, dtype, tp=tp)

    def kv_cache_specs(self) -> list[AttentionSpec]:
        return [self.attention_spec if t == "full_attention" else self.delta_spec for t in self.dims.layer_types]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)
        cos_sin = self.rotary.cos_sin(positions, h.dtype)
        for layer in self.model.layers:
            h = layer(h, ctx, cos_sin)
        return self.model.norm(h)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return gather_logits(self.lm_head, hidden_states)

    def compute_greedy_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return gather_argmax(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def renamed():
            for name, tensor in weights:
                if name.startswith("mtp."):
                    continue  # the multi-token-prediction block: the mtp proposer's (engine_qwen.mtp)
                if name.startswith("lm_head.") and self.tie_word_embeddings:
                    continue
                name = name.replace(".linear_attn.", ".mixer.").replace(".self_attn.", ".mixer.")
                if name.endswith(".mixer.in_proj_qkv.weight"):  # q, k and v stacked: each splits by head
                    prefix = name.removesuffix("in_proj_qkv.weight")
                    for part, rows in zip("qkv", tensor.split(widths, dim=0)):
                        yield f"{prefix}in_proj_{part}.weight", rows
                elif name.endswith(".mixer.conv1d.weight"):  # the q, k and v channels' convolutions
                    prefix = name.removesuffix("conv1d.weight")
                    for part, rows in zip("qkv", tensor.split(widths, dim=0)):
                        yield f"{prefix}{part}_conv", rows
                else:
                    yield name, tensor

        d = self.dims
        widths = [d.key_heads * d.key_dim, d.key_heads * d.key_dim, d.value_heads * d.value_dim]
        loaded = load_named_tensors(self, renamed(), STACKED)
        for layer in self.model.layers:
            if isinstance(layer.mixer, GatedDeltaNet):
                layer.mixer.weights_loaded()
        return loaded


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5-MoE: every layer's MLP is routed experts (softmax top-k, renormalised) and a
    gated shared expert."""

    @classmethod
    def make_mlp(cls, config: HFConfig, d: Dims, index: int, dtype: torch.dtype, tp) -> nn.Module:
        return SparseMoE(config, d.hidden_size, dtype, tp)


class Qwen3NextForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3-Next: Qwen3.5-MoE's layers, with routed experts where ``decoder_sparse_step`` says
    and not in ``mlp_only_layers`` (dense MLPs elsewhere), top-k weights renormalised only
    with ``norm_topk_prob``, and the DeltaNet's input projections fused per key head:
    ``in_proj_qkvz`` holds, for each key head, its q, k, then the v and z of the value heads it
    serves, ``in_proj_ba`` their b then a. Loading regroups them into Qwen3.5's
    ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``."""

    tool_parser = "hermes"  # Qwen3-Next-Instruct writes <tool_call> JSON

    @classmethod
    def make_mlp(cls, config: HFConfig, d: Dims, index: int, dtype: torch.dtype, tp) -> nn.Module:
        sparse = (
            index not in (config.get("mlp_only_layers") or ())
            and config.get("num_experts", 0) > 0
            and (index + 1) % int(config.get("decoder_sparse_step", 1)) == 0
        )
        return SparseMoE(config, d.hidden_size, dtype, tp) if sparse else super().make_mlp(config, d, index, dtype, tp)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        d = self.dims
        repeat = d.value_heads // d.key_heads

        def regrouped():
            for name, tensor in weights:
                if name.endswith(".linear_attn.in_proj_qkvz.weight"):
                    prefix = name.removesuffix("in_proj_qkvz.weight")
                    per_head = tensor.reshape(d.key_heads, 2 * d.key_dim + 2 * repeat * d.value_dim, -1)
                    q, k, v, z = per_head.split([d.key_dim, d.key_dim, repeat * d.value_dim, repeat * d.value_dim], 1)
                    flat = [part.reshape(-1, tensor.shape[-1]) for part in (q, k, v)]
                    yield prefix + "in_proj_qkv.weight", torch.cat(flat)
                    yield prefix + "in_proj_z.weight", z.reshape(-1, tensor.shape[-1])
                elif name.endswith(".linear_attn.in_proj_ba.weight"):
                    prefix = name.removesuffix("in_proj_ba.weight")
                    b, a = tensor.reshape(d.key_heads, 2 * repeat, -1).split([repeat, repeat], 1)
                    yield prefix + "in_proj_b.weight", b.reshape(-1, tensor.shape[-1])
                    yield prefix + "in_proj_a.weight", a.reshape(-1, tensor.shape[-1])
                else:
                    yield name, tensor

        return super().load_weights(regrouped())


def text_only(init: ModelInit) -> ModelInit:
    """A multimodal checkpoint's ``ModelInit`` with its ``text_config`` as the config."""
    text = init.config.to_dict().get("text_config")
    if not text:
        raise ValueError("A Qwen3.5 multimodal checkpoint's config.json has no text_config.")
    return dataclasses.replace(init, config=HFConfig(text))


def language_model_tensors(weights: Iterable[tuple[str, torch.Tensor]]):
    """The text model's tensors of a multimodal checkpoint, named as the text checkpoints name
    them; the vision tower's are counted and left out."""
    skipped = 0
    for name, tensor in weights:
        if name.startswith(("model.visual.", "visual.")):
            skipped += 1
            continue
        yield name.replace("model.language_model.", "model.", 1), tensor
    if skipped:
        logger.info("skipped %d vision-tower tensors: the model serves text prompts", skipped)


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    """Qwen3.5's published (multimodal) checkpoints, text only."""

    def __init__(self, init: ModelInit) -> None:
        super().__init__(text_only(init))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(language_model_tensors(weights))


class Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeForCausalLM):
    """Qwen3.5-MoE's published (multimodal) checkpoints, text only."""

    def __init__(self, init: ModelInit) -> None:
        super().__init__(text_only(init))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(language_model_tensors(weights))
