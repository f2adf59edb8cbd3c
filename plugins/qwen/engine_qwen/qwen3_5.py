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

from engine.interfaces.attention import LINEAR, MHA, AttentionSpec
from engine.interfaces.forward_context import ForwardContext
from engine.interfaces.model import Model, ModelInit
from engine.layers.attention import Attention
from engine.layers.decoder import GATE_UP_PARAMS, GatedMLP, require_silu
from engine.layers.linear import Linear, MergedLinear, VocabEmbedding, gather_logits
from engine.layers.moe import Experts, load_named_tensors
from engine.layers.rotary import RotaryEmbedding, rope_parameters
from engine.model_config import HFConfig

logger = logging.getLogger("engine.qwen")

STACKED = {
    **GATE_UP_PARAMS,
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "in_proj_qkv": ("in_proj", 0),
    "in_proj_z": ("in_proj", 1),
    "in_proj_b": ("in_proj", 2),
    "in_proj_a": ("in_proj", 3),
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


class GatedDeltaNet(nn.Module):
    def __init__(self, d: Dims, spec: AttentionSpec, layer_index: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.d, self.layer_index = d, layer_index
        key_width, value_width = d.key_heads * d.key_dim, d.value_heads * d.value_dim
        self.in_proj = MergedLinear(
            d.hidden_size, [2 * key_width + value_width, value_width, d.value_heads, d.value_heads], False, dtype
        )
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(
            torch.empty(2 * key_width + value_width, 1, d.conv_kernel, dtype=dtype), requires_grad=False
        )
        self.dt_bias = nn.Parameter(torch.empty(d.value_heads, dtype=dtype), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(d.value_heads, dtype=dtype), requires_grad=False)
        self.norm = GatedRMSNorm(d.value_dim, d.eps, dtype)
        self.out_proj = Linear(value_width, d.hidden_size, False, dtype)
        self.repeat = d.value_heads // d.key_heads

    def forward(self, x: torch.Tensor, ctx: ForwardContext, cos_sin=None) -> torch.Tensor:
        d = self.d
        key_width, value_width = d.key_heads * d.key_dim, d.value_heads * d.value_dim
        qkv, z, b, a = self.in_proj(x).split(
            [2 * key_width + value_width, value_width, d.value_heads, d.value_heads], -1
        )
        beta = torch.sigmoid(b).float()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # [T, value heads]
        g = g.unsqueeze(-1).expand(-1, -1, d.key_dim).contiguous()  # one decay for all of a head's channels
        conv = self.conv1d.weight.squeeze(1)
        if self.repeat > 1:  # each key head serves `repeat` consecutive value heads
            qkv, conv = (
                expand_key_heads(qkv, d, self.repeat),
                expand_key_heads(conv.t(), d, self.repeat).t().contiguous(),
            )
        out = ctx.linear(self.layer_index, qkv, conv, g, beta)  # [T, value heads, value dim]
        out = self.norm(out, z.view(-1, d.value_heads, d.value_dim))
        return self.out_proj(out.reshape(x.shape[0], value_width))


def expand_key_heads(qkv: torch.Tensor, d: Dims, repeat: int) -> torch.Tensor:
    """[N, q | k | v] (q, k per key head) -> [N, q' | k' | v] with q' and k' per value head,
    each key head repeated for the ``repeat`` value heads it serves."""
    key_width = d.key_heads * d.key_dim
    q, k, v = qkv.split([key_width, key_width, qkv.shape[-1] - 2 * key_width], dim=-1)
    n = qkv.shape[0]

    def widen(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(n, d.key_heads, d.key_dim).repeat_interleave(repeat, dim=1).reshape(n, -1)

    return torch.cat([widen(q), widen(k), v], dim=-1)


class GatedAttention(nn.Module):
    def __init__(self, d: Dims, spec: AttentionSpec, layer_index: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.d = d
        self.qkv_proj = MergedLinear(
            d.hidden_size,
            [2 * d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim, d.num_kv_heads * d.head_dim],
            False,
            dtype,
        )
        self.q_norm = ZeroCenteredRMSNorm(d.head_dim, d.eps, dtype)
        self.k_norm = ZeroCenteredRMSNorm(d.head_dim, d.eps, dtype)
        self.o_proj = Linear(d.num_heads * d.head_dim, d.hidden_size, False, dtype)
        self.attn = Attention(layer_index, spec)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, cos_sin) -> torch.Tensor:
        d, n = self.d, x.shape[0]
        qg, k, v = self.qkv_proj(x).split(self.qkv_proj.output_sizes, dim=-1)
        qg = qg.view(n, d.num_heads, 2 * d.head_dim)
        q, gate = qg[..., : d.head_dim], qg[..., d.head_dim :].reshape(n, -1)
        q = self.q_norm(q)
        k = self.k_norm(k.reshape(n, d.num_kv_heads, d.head_dim))
        q, k = ctx.ops.rotary(q.contiguous(), k.contiguous(), *cos_sin)
        out = self.attn(q, k, v.reshape(n, d.num_kv_heads, d.head_dim).contiguous(), ctx)
        return self.o_proj(out.reshape(n, -1) * torch.sigmoid(gate))


class SoftmaxRouter(nn.Module):
    """Softmax over the experts in float32, the top ``k`` renormalised, rounded to the model's
    dtype (transformers' Qwen3.5-MoE router)."""

    def __init__(self, num_experts: int, hidden_size: int, k: int, normalize: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype), requires_grad=False)
        self.k, self.normalize = k, normalize

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)
        top, chosen = torch.softmax(logits, dim=-1, dtype=torch.float32).topk(self.k, dim=-1)
        if self.normalize:
            top = top / top.sum(dim=-1, keepdim=True)
        return chosen, top.to(logits.dtype).float()


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
    supports_tensor_parallel = False  # the DeltaNet's heads are not split yet
    tool_parser = "qwen3_coder"  # <tool_call><function=...><parameter=...> (engine_qwen.parsers)
    reasoning_parser = "qwen3"  # <think> ... </think>, engine-llama's

    def __init__(self, init: ModelInit) -> None:
        super().__init__()
        config, dtype, tp = init.config, init.dtype, init.tp
        require_silu(config, self)
        d = self.dims = Dims.from_config(config)
        self.attention_spec = AttentionSpec(MHA, d.num_heads, d.num_kv_heads, d.head_dim, d.head_dim**-0.5)
        self.delta_spec = AttentionSpec(
            LINEAR,
            d.value_heads,
            d.value_heads,
            d.key_dim,
            d.key_dim**-0.5,
            value_size=d.value_dim,
            conv_kernel=d.conv_kernel,
        )
        with torch.device(init.device):
            layers = []
            for i, kind in enumerate(d.layer_types):
                mixer = (
                    GatedAttention(d, self.attention_spec, i, dtype)
                    if kind == "full_attention"
                    else GatedDeltaNet(d, self.delta_spec, i, dtype)
                )
                layers.append(DecoderLayer(mixer, self.make_mlp(config, d, i, dtype, tp), d, dtype))
            self.model = nn.Module()
            self.model.embed_tokens = VocabEmbedding(d.vocab_size, d.hidden_size, dtype, tp=tp)
            self.model.layers = nn.ModuleList(layers)
            self.model.norm = ZeroCenteredRMSNorm(d.hidden_size, d.eps, dtype)
            self.rotary = RotaryEmbedding(d.head_dim, d.max_positions, rope_parameters(config), rotary_dim=d.rotary_dim)
            self.tie_word_embeddings = bool(config.get("tie_word_embeddings", False))
            self.lm_head = Linear(d.hidden_size, d.vocab_size, False, dtype)
            if self.tie_word_embeddings:
                self.lm_head.weight = self.model.embed_tokens.weight

    def make_mlp(self, config: HFConfig, d: Dims, index: int, dtype: torch.dtype, tp) -> nn.Module:
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

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def renamed():
            for name, tensor in weights:
                if name.startswith("mtp."):
                    continue  # the multi-token-prediction layer: not a proposer here yet
                if name.startswith("lm_head.") and self.tie_word_embeddings:
                    continue
                yield name.replace(".linear_attn.", ".mixer.").replace(".self_attn.", ".mixer."), tensor

        return load_named_tensors(self, renamed(), STACKED)


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5-MoE: every layer's MLP is routed experts (softmax top-k, renormalised) and a
    gated shared expert."""

    def make_mlp(self, config: HFConfig, d: Dims, index: int, dtype: torch.dtype, tp) -> nn.Module:
        return SparseMoE(config, d.hidden_size, dtype, tp)


class Qwen3NextForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3-Next: Qwen3.5-MoE's layers, with routed experts where ``decoder_sparse_step`` says
    and not in ``mlp_only_layers`` (dense MLPs elsewhere), top-k weights renormalised only
    with ``norm_topk_prob``, and the DeltaNet's input projections fused per key head:
    ``in_proj_qkvz`` holds, for each key head, its q, k, then the v and z of the value heads it
    serves, ``in_proj_ba`` their b then a. Loading regroups them into Qwen3.5's
    ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``."""

    tool_parser = "hermes"  # Qwen3-Next-Instruct writes <tool_call> JSON

    def make_mlp(self, config: HFConfig, d: Dims, index: int, dtype: torch.dtype, tp) -> nn.Module:
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
