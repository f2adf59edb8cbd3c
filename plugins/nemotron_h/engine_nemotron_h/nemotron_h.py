"""Nemotron-H (``NemotronHForCausalLM``): a stack of single-mixer blocks, each
``h + mixer(norm(h))``, whose mixers ``layers_block_type`` (or the older
``hybrid_override_pattern``) lists: ``M`` a Mamba-2 mixer, ``*`` attention, ``-`` an MLP,
``E`` routed experts.

- **Mamba-2 mixer** (``linear_attention``). ``in_proj`` gives the output gate z
  ([``mamba_num_heads · mamba_head_dim``]), xBC (x, then B and C of ``n_groups ·
  ssm_state_size`` each) and the time steps dt (one a head). xBC passes a causal depthwise
  convolution (``conv1d``, with bias when ``use_conv_bias``) and SiLU; the selective scan
  ``S = exp(Δ A) S + Δ x Bᵀ``, ``y = S C + D x`` with ``Δ = clamp(softplus(dt + dt_bias),
  time_step_limit)`` and ``A = -exp(A_log)`` runs on the platform's ``mamba2`` backend
  (``forward_mamba2``), which keeps each request's state. Then the gated norm: ``y ·
  silu(z)`` RMS-normalised per group of ``mamba_num_heads · mamba_head_dim / n_groups``
  channels, times ``norm.weight``, all in float32; then ``out_proj``.
- **Attention** (``full_attention``): grouped-query attention, no positional encoding (the
  Mamba layers carry position), no biases.
- **MLP** (``mlp``): ``down_proj(relu(up_proj(x))²)``, not gated.
- **Routed experts** (``moe``): DeepSeek-V3's sigmoid router (score correction bias, expert
  groups, ``routed_scaling_factor``) over non-gated relu² experts, optionally inside a latent
  projection (``fc1_latent_proj`` / ``fc2_latent_proj``), plus a shared relu² MLP.
- **Norms** multiply by their weight in float32 and round after.

Checkpoints name the model ``model.*`` (transformers) or ``backbone.*`` (NVIDIA's own);
experts stacked (``experts.up_proj`` [E, I, hidden]) or one by one
(``experts.{e}.up_proj.weight``). Multi-token-prediction layers (``mtp.*``) are skipped.
``tie_word_embeddings`` is ignored, as transformers' NemotronH ignores it.

Under tensor parallelism each rank runs its attention heads, its Mamba-2 heads with the
groups of B and C they read (one group for all heads: on every rank), its part of each MLP's
and each expert's intermediate size; the router and latent projections are whole on every rank.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import TensorParallel
from engine.interfaces.attention import MAMBA2, MHA, AttentionSpec
from engine.interfaces.forward_context import ForwardContext
from engine.interfaces.model import Model, ModelInit
from engine.layers.attention import Attention
from engine.layers.decoder import load_tensor
from engine.layers.linear import (
    ColumnParallelLinear,
    Linear,
    MergedLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabEmbedding,
    gather_argmax,
    gather_logits,
    linear_layers,
    shard_parameter,
)
from engine.layers.moe import MoEDims, Router
from engine.layers.quantized_checkpoint import dense_tensor
from engine.model_config import HFConfig

IN_PROJ_PARTS = ("z", "x", "B", "C", "dt")  # the Mamba mixer's in_proj rows, in order
STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    # the checkpoints' in_proj and conv1d, cut in parts at load (each splits by head or group)
    **{f"in_proj_{part}": ("in_proj", i) for i, part in enumerate(IN_PROJ_PARTS)},
}
PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
EXPERT_TENSOR = re.compile(r"(?P<experts>.+\.mixer\.experts)\.(?P<expert>\d+)\.(?P<proj>up_proj|down_proj)\.weight$")


def layer_types(config: HFConfig) -> tuple[str, ...]:
    """``layers_block_type`` (transformers' name), else ``hybrid_override_pattern`` read through
    ``M * - E``; anything else is refused."""
    types = config.get("layers_block_type") or config.get("layer_types")
    if types is None:
        pattern = config.get("hybrid_override_pattern")
        if pattern is None:
            raise ValueError("A Nemotron-H config.json needs layers_block_type or hybrid_override_pattern.")
        unknown = sorted(set(pattern) - set(PATTERN))
        if unknown:
            raise ValueError(
                f"hybrid_override_pattern {pattern!r} has layer symbols {unknown} this model does not know; "
                f"it serves {', '.join(f'{s} ({t})' for s, t in PATTERN.items())}."
            )
        types = [PATTERN[s] for s in pattern]
    unknown = sorted(set(types) - set(PATTERN.values()))
    if unknown:
        raise ValueError(
            f"layers_block_type has layer types {unknown} this model does not serve; "
            f"it serves {', '.join(PATTERN.values())}."
        )
    return tuple(types)


def setting(config: HFConfig, name: str, older: str, default):
    """A config field under its transformers name, else under the older checkpoints' name."""
    value = config.get(name)
    return config.get(older, default) if value is None else value


def json_float(value) -> float:
    """A number of config.json, where transformers writes infinity as ``{"__float__": "Infinity"}``."""
    if isinstance(value, HFConfig):
        value = value.to_dict()
    if isinstance(value, dict):
        value = value["__float__"]
    return float(value)


@dataclass(frozen=True)
class Dims:
    hidden_size: int
    vocab_size: int
    layer_types: tuple[str, ...]
    eps: float
    # attention
    num_heads: int
    num_kv_heads: int
    head_dim: int
    # Mamba-2
    mamba_heads: int
    mamba_head_dim: int
    state_size: int
    groups: int
    conv_kernel: int
    conv_bias: bool
    dt_limit: tuple[float, float]
    use_bias: bool
    # MLPs
    intermediate_size: int
    mlp_bias: bool

    @property
    def mamba_width(self) -> int:
        return self.mamba_heads * self.mamba_head_dim

    @property
    def conv_channels(self) -> int:
        return self.mamba_width + 2 * self.groups * self.state_size

    @classmethod
    def from_config(cls, config: HFConfig) -> Dims:
        for field, wanted in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
            if config.get(field, wanted) != wanted:
                raise ValueError(f"Nemotron-H's {field} must be {wanted!r}; this config has {config.get(field)!r}.")
        heads = config.num_attention_heads
        mamba_heads, groups = config.mamba_num_heads, setting(config, "n_groups", "mamba_n_groups", 8)
        if mamba_heads % groups:
            raise ValueError(f"mamba_num_heads ({mamba_heads}) must be a multiple of n_groups ({groups}).")
        low, high = setting(config, "time_step_limit", "mamba_dt_limit", (0.0, float("inf")))
        return cls(
            hidden_size=config.hidden_size,
            vocab_size=config.vocab_size,
            layer_types=layer_types(config),
            eps=config.get("layer_norm_epsilon", 1e-5),
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads", heads),
            head_dim=config.get("head_dim") or config.hidden_size // heads,
            mamba_heads=mamba_heads,
            mamba_head_dim=config.mamba_head_dim,
            state_size=config.ssm_state_size,
            groups=groups,
            conv_kernel=setting(config, "conv_kernel", "mamba_d_conv", 4),
            conv_bias=bool(setting(config, "use_conv_bias", "mamba_conv_bias", True)),
            dt_limit=(json_float(low), json_float(high)),
            use_bias=bool(config.get("use_bias", False)),
            intermediate_size=config.get("intermediate_size", 0),
            mlp_bias=bool(config.get("mlp_bias", False)),
        )


def parameter(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


def sharded(shape: tuple[int, ...], dtype: torch.dtype, first: int, full: int, dim: int = 0) -> nn.Parameter:
    """A parameter holding this rank's ``shape[dim]`` of ``full`` entries of a checkpoint tensor along
    ``dim``, from ``first``."""
    return shard_parameter(parameter(*shape, dtype=dtype), dim, first, full)


def group_split(tp: TensorParallel, groups: int) -> tuple[int, int]:
    """This rank's ``(first group, count)`` of B and C: an even split when the groups divide over
    the ranks, else (one group for all heads) the group replicated on every rank."""
    if groups % tp.size == 0:
        return tp.split(groups, "n_groups")
    if groups == 1:
        return 0, 1
    raise ValueError(
        f"n_groups ({groups}) is neither 1 nor divisible by the tensor-parallel size {tp.size}; "
        f"choose a --tensor-parallel-size that divides it."
    )


class RMSNorm(nn.Module):
    """Normalised in float32, times the weight in float32, rounded to x's dtype."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = parameter(size, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * normed).to(x.dtype)


class GatedGroupNorm(nn.Module):
    """The Mamba mixer's output norm: ``y · silu(z)``, RMS-normalised per group of ``group_size``
    channels, times the weight, in float32. A group wider than this rank's channels (one group
    for all heads, split over the ranks) sums its squares over the ranks."""

    def __init__(self, size: int, group_size: int, eps: float, dtype: torch.dtype, tp: TensorParallel) -> None:
        super().__init__()
        self.weight = parameter(size, dtype=dtype)
        self.group_size, self.eps = group_size, eps
        self.tp = tp if group_size > size else None

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        gated = y.float() * F.silu(gate.float())  # [T, width]
        if self.tp is not None:
            mean_square = self.tp.all_reduce(gated.square().sum(-1, keepdim=True)) / self.group_size
            normed = gated * torch.rsqrt(mean_square + self.eps)
        else:
            grouped = gated.view(gated.shape[0], -1, self.group_size)
            normed = (grouped * torch.rsqrt(grouped.square().mean(-1, keepdim=True) + self.eps)).view_as(gated)
        return (self.weight.float() * normed).to(gate.dtype)


class Mamba2Mixer(nn.Module):
    """Under tensor parallelism each rank runs its heads and the groups of B and C they read:
    the projections, convolution channels, time steps, norm and states split by head (and
    group), ``out_proj`` summed over the ranks."""

    def __init__(self, d: Dims, layer_index: int, dtype: torch.dtype, tp: TensorParallel) -> None:
        super().__init__()
        self.d, self.layer_index = d, layer_index
        first_head, self.heads = tp.split(d.mamba_heads, "mamba_num_heads")
        first_group, self.groups = group_split(tp, d.groups)
        p, n, kernel = d.mamba_head_dim, d.state_size, d.conv_kernel
        width, group_width = d.mamba_width, d.groups * n
        heads_part, groups_part = (first_head * p, self.heads * p), (first_group * n, self.groups * n)
        slices = [heads_part, heads_part, groups_part, groups_part, (first_head, self.heads)]  # z, x, B, C, dt
        full = [width, width, group_width, group_width, d.mamba_heads]
        self.in_proj = MergedLinear(
            d.hidden_size,
            [length for _, length in slices],
            d.use_bias,
            dtype,
            out_slices=slices if tp.is_parallel else None,
            full_output_sizes=full,
            tp=tp,
        )
        self.x_conv = sharded((self.heads * p, 1, kernel), dtype, heads_part[0], width)
        self.B_conv = sharded((self.groups * n, 1, kernel), dtype, groups_part[0], group_width)
        self.C_conv = sharded((self.groups * n, 1, kernel), dtype, groups_part[0], group_width)
        if d.conv_bias:
            self.x_conv_bias = sharded((self.heads * p,), dtype, heads_part[0], width)
            self.B_conv_bias = sharded((self.groups * n,), dtype, groups_part[0], group_width)
            self.C_conv_bias = sharded((self.groups * n,), dtype, groups_part[0], group_width)
        self.dt_bias = sharded((self.heads,), dtype, first_head, d.mamba_heads)
        self.A_log = sharded((self.heads,), dtype, first_head, d.mamba_heads)
        self.D = sharded((self.heads,), dtype, first_head, d.mamba_heads)
        self.norm = GatedGroupNorm(self.heads * p, width // d.groups, d.eps, dtype, tp)
        shard_parameter(self.norm.weight, 0, first_head * p, width)
        self.out_proj = RowParallelLinear(width, d.hidden_size, d.use_bias, dtype, "mamba_num_heads × head_dim", tp=tp)
        # the convolution as the backend takes it, [channels, kernel] and [channels] (after loading)
        self.conv: torch.Tensor | None = None
        self.conv_bias: torch.Tensor | None = None

    def weights_loaded(self) -> None:
        """Put the x, B and C channels' convolution together once the checkpoint is in."""
        self.conv = torch.cat([self.x_conv, self.B_conv, self.C_conv]).squeeze(1)
        if self.d.conv_bias:
            self.conv_bias = torch.cat([self.x_conv_bias, self.B_conv_bias, self.C_conv_bias])

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        if self.conv is None:
            raise RuntimeError("Mamba2Mixer ran before its model's load_weights built its convolution.")
        width = self.heads * self.d.mamba_head_dim
        gate, xbc, dt = self.in_proj(x).split([width, self.conv.shape[0], self.heads], dim=-1)  # x, B, C adjacent
        A = -self.A_log.float().exp()
        y = ctx.mamba2(self.layer_index, xbc, self.conv, self.conv_bias, dt, self.dt_bias, A, self.D)
        return self.out_proj(self.norm(y.reshape(x.shape[0], -1), gate))


class SelfAttention(nn.Module):
    """Grouped-query attention without positional encoding; under tensor parallelism this rank's
    query heads and KV heads."""

    def __init__(self, d: Dims, spec: AttentionSpec, layer_index: int, dtype: torch.dtype, tp) -> None:
        super().__init__()
        self.d, self.heads, self.kv_heads = d, spec.num_heads, spec.num_kv_heads
        self.qkv_proj = QKVParallelLinear(d.hidden_size, d.num_heads, d.num_kv_heads, d.head_dim, False, dtype, tp=tp)
        self.o_proj = RowParallelLinear(
            d.num_heads * d.head_dim, d.hidden_size, False, dtype, "num_attention_heads × head_dim", tp=tp
        )
        self.attn = Attention(layer_index, spec)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        d, n = self.d, x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.output_sizes, dim=-1)
        q = q.reshape(n, self.heads, d.head_dim)
        k, v = (t.reshape(n, self.kv_heads, d.head_dim) for t in (k, v))
        return self.o_proj(self.attn(q, k, v, ctx).reshape(n, -1))


class ReluSquaredMLP(nn.Module):
    """``down_proj(relu(up_proj(x))²)``; under tensor parallelism this rank's part of the
    intermediate size, the outputs summed over the ranks."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, dtype: torch.dtype, tp) -> None:
        super().__init__()
        self.up_proj = ColumnParallelLinear(hidden_size, [intermediate_size], bias, dtype, "intermediate_size", tp=tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, dtype, "intermediate_size", tp=tp)

    def forward(self, x: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
        return self.down_proj(F.relu(self.up_proj(x)).square())


class ReluSquaredExperts(nn.Module):
    """Non-gated experts stacked as transformers stores them: up_proj [E, I, width], down_proj
    [E, width, I]; each active expert runs one pair of matmuls over its tokens. Under tensor
    parallelism every rank holds every expert's part of the intermediate size and the ranks
    sum their outputs (as ``engine.layers.moe.Experts``)."""

    def __init__(self, num_experts: int, intermediate_size: int, width: int, dtype: torch.dtype, tp) -> None:
        super().__init__()
        self.tp = tp
        self.start, local = tp.split(intermediate_size, "moe_intermediate_size")
        self.up_proj = sharded((num_experts, local, width), dtype, self.start, intermediate_size, dim=1)
        self.down_proj = sharded((num_experts, width, local), dtype, self.start, intermediate_size, dim=2)

    def load_expert(self, name: str, expert: int, proj: str, tensor: torch.Tensor) -> None:
        """One expert's ``up_proj`` [I, width] or ``down_proj`` [width, I] weight, this rank's part."""
        target = getattr(self, proj)
        local = target.shape[1] if proj == "up_proj" else target.shape[2]
        tensor = dense_tensor(name, tensor, target.dtype).narrow(0 if proj == "up_proj" else 1, self.start, local)
        target.data[expert].copy_(tensor)

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        k = expert_ids.shape[1]
        flat = expert_ids.flatten()
        order = flat.argsort(stable=True)
        token_of = order // k
        counts = torch.bincount(flat, minlength=self.up_proj.shape[0]).tolist()
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows, tokens = order[start : start + count], token_of[start : start + count]
            start += count
            h = F.relu(x[tokens] @ self.up_proj[expert].t()).square() @ self.down_proj[expert].t()
            out.index_add_(0, tokens, h.float() * weights.flatten()[rows].unsqueeze(1))
        return self.tp.all_reduce(out).to(x.dtype)


class MoE(nn.Module):
    def __init__(self, config: HFConfig, d: Dims, dtype: torch.dtype, tp: TensorParallel) -> None:
        super().__init__()
        num_experts = config.get("n_routed_experts") or config.num_local_experts
        dims = MoEDims(
            hidden_size=d.hidden_size,
            moe_intermediate_size=config.moe_intermediate_size,
            num_experts=num_experts,
            experts_per_token=config.num_experts_per_tok,
            num_groups=config.get("n_group", 1),
            top_groups=config.get("topk_group", 1),
            num_shared_experts=1,
            routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(config.get("norm_topk_prob", True)),
        )
        self.gate = Router(dims)
        latent = config.get("moe_latent_size")
        width = latent or d.hidden_size
        self.experts = ReluSquaredExperts(num_experts, config.moe_intermediate_size, width, dtype, tp)
        shared = config.get("moe_shared_expert_intermediate_size", config.moe_intermediate_size)
        self.shared_experts = ReluSquaredMLP(d.hidden_size, shared, d.mlp_bias, dtype, tp)
        self.fc1_latent_proj = Linear(d.hidden_size, latent, d.mlp_bias, dtype) if latent else None
        self.fc2_latent_proj = Linear(latent, d.hidden_size, d.mlp_bias, dtype) if latent else None

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        expert_ids, weights = self.gate(x)
        routed = self.fc1_latent_proj(x) if self.fc1_latent_proj is not None else x
        routed = self.experts(routed, expert_ids, weights)
        if self.fc2_latent_proj is not None:
            routed = self.fc2_latent_proj(routed)
        return routed + self.shared_experts(x)


class Block(nn.Module):
    def __init__(self, mixer: nn.Module, d: Dims, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm = RMSNorm(d.hidden_size, d.eps, dtype)
        self.mixer = mixer

    def forward(self, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return h + self.mixer(self.norm(h), ctx)


class NemotronHForCausalLM(Model):
    supports_tensor_parallel = True

    def __init__(self, init: ModelInit) -> None:
        super().__init__()
        config, dtype, tp = init.config, init.dtype, init.tp
        d = self.dims = Dims.from_config(config)
        # the specs count this rank's heads and groups
        self.attention_spec = AttentionSpec(
            MHA,
            tp.split(d.num_heads, "num_attention_heads")[1],
            tp.kv_heads(d.num_kv_heads)[1],
            d.head_dim,
            d.head_dim**-0.5,
            total_kv_heads=d.num_kv_heads if tp.is_parallel else None,
        )
        mamba_heads = tp.split(d.mamba_heads, "mamba_num_heads")[1]
        self.mamba_spec = AttentionSpec(
            MAMBA2,
            mamba_heads,
            mamba_heads,
            d.mamba_head_dim,
            1.0,
            conv_kernel=d.conv_kernel,
            state_size=d.state_size,
            num_groups=group_split(tp, d.groups)[1],
            dt_limit=d.dt_limit,
            total_num_heads=d.mamba_heads if tp.is_parallel else None,
            total_num_groups=d.groups if tp.is_parallel else None,
        )
        self.specs: list[AttentionSpec] = []  # one per layer that keeps a cache, in layer order
        with torch.device(init.device):
            layers = [Block(self.make_mixer(config, d, kind, dtype, tp), d, dtype) for kind in d.layer_types]
            self.model = nn.Module()
            self.model.embeddings = VocabEmbedding(d.vocab_size, d.hidden_size, dtype, tp=tp)
            self.model.layers = nn.ModuleList(layers)
            self.model.norm_f = RMSNorm(d.hidden_size, d.eps, dtype)
            # an LM head of its own even with tie_word_embeddings, as transformers' NemotronH has
            self.lm_head = ParallelLMHead(d.hidden_size, d.vocab_size, dtype, tp=tp)

    def make_mixer(self, config: HFConfig, d: Dims, kind: str, dtype: torch.dtype, tp: TensorParallel) -> nn.Module:
        if kind == "linear_attention":
            self.specs.append(self.mamba_spec)
            return Mamba2Mixer(d, len(self.specs) - 1, dtype, tp)
        if kind == "full_attention":
            self.specs.append(self.attention_spec)
            return SelfAttention(d, self.attention_spec, len(self.specs) - 1, dtype, tp)
        if kind == "mlp":
            return ReluSquaredMLP(d.hidden_size, d.intermediate_size, d.mlp_bias, dtype, tp)
        return MoE(config, d, dtype, tp)

    def kv_cache_specs(self) -> list[AttentionSpec]:
        return list(self.specs)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = self.model.embeddings(input_ids)
        for layer in self.model.layers:
            h = layer(h, ctx)
        return self.model.norm_f(h)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return gather_logits(self.lm_head, hidden_states)

    def compute_greedy_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return gather_argmax(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        d = self.dims
        params, linears = dict(self.named_parameters()), linear_layers(self)
        widths = [d.mamba_width, d.mamba_width, d.groups * d.state_size, d.groups * d.state_size, d.mamba_heads]
        loaded: set[str] = set()
        experts_seen: dict[str, set[tuple[int, str]]] = {}
        for name, tensor in renamed(weights, widths):
            expert = EXPERT_TENSOR.match(name)
            if expert:  # one expert's projection: its row of the stacked parameter
                path, proj, index = expert.group("experts"), expert.group("proj"), int(expert.group("expert"))
                experts = self.get_submodule(path)
                experts.load_expert(name, index, proj, tensor)
                seen = experts_seen.setdefault(path, set())
                seen.add((index, proj))
                if len(seen) == 2 * experts.up_proj.shape[0]:
                    loaded |= {f"{path}.up_proj", f"{path}.down_proj"}
                continue
            loaded |= load_tensor(self, params, linears, name, tensor, STACKED)
        for layer in self.model.layers:
            if isinstance(layer.mixer, Mamba2Mixer):
                layer.mixer.weights_loaded()
        return loaded


def renamed(weights: Iterable[tuple[str, torch.Tensor]], widths: list[int]):
    """Checkpoint tensors under this model's names: ``backbone.`` as ``model.``, the Mamba
    mixers' ``in_proj`` cut into z, x, B, C and dt and ``conv1d`` into x, B and C (each part
    splits by head or group), multi-token-prediction layers left out."""
    for name, tensor in weights:
        if name.startswith("mtp."):
            continue  # multi-token-prediction layers: not a proposer here
        if name.startswith("backbone."):  # NVIDIA's own checkpoints
            name = "model." + name.removeprefix("backbone.")
        in_proj = re.match(r"(.+\.mixer\.)in_proj\.(weight|bias)$", name)
        conv = re.match(r"(.+\.mixer\.)conv1d\.(weight|bias)$", name)
        if in_proj:
            prefix, kind = in_proj.groups()
            for part, rows in zip(IN_PROJ_PARTS, tensor.split(widths, dim=0)):
                yield f"{prefix}in_proj_{part}.{kind}", rows
        elif conv:
            prefix, kind = conv.groups()
            suffix = "_bias" if kind == "bias" else ""
            for part, rows in zip("xBC", tensor.split(widths[1:4], dim=0)):
                yield f"{prefix}{part}_conv{suffix}", rows
        else:
            yield name, tensor
