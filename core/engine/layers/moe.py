"""Routed mixtures of experts (DeepSeek-V3 lineage: DeepSeek, Kimi), shared by model plugins.

The router scores with a sigmoid in float32 and picks experts by score plus
``e_score_correction_bias`` within the best groups; the experts' weights are stacked per
layer and run one pair of matmuls per active expert over its tokens, sorted by expert.
:func:`load_named_tensors` fills a model of such layers from checkpoint names (per-expert
or transformers' stacked experts, fused linear layers, plain parameters).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.parallel_state import TensorParallel, resolve_tp
from engine.layers.decoder import GATE_UP_PARAMS, GatedMLP, load_tensor
from engine.layers.linear import linear_layers
from engine.layers.quantized_checkpoint import dense_tensor

if TYPE_CHECKING:
    from engine.interfaces.forward_context import ForwardContext
    from engine.interfaces.quantizer import ExpertsMethod, ExpertWeight, Quantizer

# an expert projection's tensor: `weight`, or a quantized format's own names (qweight, scales, ...)
EXPERT_TENSOR = re.compile(
    r"(?P<moe>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.(?P<suffix>[A-Za-z_]+)$"
)
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
FUSED_EXPERT_TENSOR = re.compile(r"(?P<moe>.+\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)$")


@dataclass(frozen=True)
class MoEDims:
    """The sizes and routing of a mixture-of-experts layer."""

    hidden_size: int
    moe_intermediate_size: int
    num_experts: int
    experts_per_token: int
    num_groups: int
    top_groups: int
    num_shared_experts: int
    routed_scaling_factor: float
    norm_topk_prob: bool

    def __post_init__(self) -> None:
        if self.num_experts % self.num_groups:
            raise ValueError(
                f"The routed experts ({self.num_experts}) do not split into {self.num_groups} groups: "
                f"the config's expert count must be a multiple of its expert-group count "
                f"(n_group / num_expert_group)."
            )


class Router(nn.Module):
    """Sigmoid scores; experts chosen by score + ``e_score_correction_bias`` among the
    ``topk_group`` best groups (a group's worth: its two best biased scores); weights are
    the unbiased scores, normalised when ``norm_topk_prob``, times ``routed_scaling_factor``.
    In float32, as transformers computes it."""

    def __init__(self, dims: MoEDims) -> None:
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


class SoftmaxRouter(nn.Module):
    """Router logits ``x @ weight.T`` in the model's dtype, a softmax over them in float32, the
    top ``k`` chosen and, with ``normalize``, renormalised; with ``round_weights`` the weights
    are rounded to the model's dtype (Qwen3-MoE, Qwen3.5-MoE) rather than kept in float32
    (Mixtral), as transformers computes them."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        k: int,
        normalize: bool,
        dtype: torch.dtype,
        *,
        round_weights: bool = True,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype), requires_grad=False)
        self.k, self.normalize, self.round_weights = k, normalize, round_weights

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden] -> (expert ids [T, k], weights [T, k] float32)."""
        logits = F.linear(x, self.weight)  # [T, E]
        top, chosen = torch.softmax(logits, dim=-1, dtype=torch.float32).topk(self.k, dim=-1)
        if self.normalize:
            top = top / top.sum(dim=-1, keepdim=True)
        if self.round_weights:
            top = top.to(logits.dtype).float()
        return chosen, top


class Experts(nn.Module):
    """The routed experts' weights stacked: w13 [E, 2 * I, hidden] (gate rows then up
    rows) and w2 [E, hidden, I]. Tokens are sorted by expert and each active expert runs
    one pair of matmuls over all of its tokens. With ``swiglu_limit`` (DeepSeek-V4) the
    gate is clamped to at most the limit and the up projection to ±limit before
    ``silu(gate) * up``.

    Under tensor parallelism every rank holds every expert, each sharded within: its part of
    the intermediate size (gate and up rows, down columns), and the ranks sum their outputs.
    Routing then stays the same on every rank and needs no exchange of tokens, any expert
    count works with any rank count, and a rank's load does not depend on which experts are
    popular (expert parallelism, whole experts per rank, would need an all-to-all per layer)."""

    def __init__(
        self,
        num_experts: int,
        intermediate_size: int,
        hidden_size: int,
        dtype: torch.dtype,
        swiglu_limit: float | None = None,
        activation: Callable[[torch.Tensor], torch.Tensor] | None = None,
        *,
        tp: TensorParallel | None = None,
    ) -> None:
        """``activation``: gate_up [n, 2I] -> [n, I] in place of SiLU-and-multiply (Kimi-K3's SiTU-GLU);
        ``tp``: the ranks that split each expert."""
        super().__init__()
        self.tp = resolve_tp(tp)
        self.start, i = self.tp.split(intermediate_size, "moe_intermediate_size")  # this rank's part
        self.full_intermediate_size = intermediate_size
        e, h = num_experts, hidden_size
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, h, i, dtype=dtype), requires_grad=False)
        self.intermediate_size = i
        self.num_experts, self.hidden_size = e, h
        self.swiglu_limit = swiglu_limit
        self.custom_activation = activation
        self._loaded: set[tuple[int, str]] = set()
        # a quantizer's experts (set_method): each expert projection's tensors by suffix until
        # loading ends, then per expert the gate and up weights (joined where they share a
        # layout) and the down weight as the method holds them (ExpertWeight)
        self.method: ExpertsMethod | None = None
        self._staged: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        self.gate_up: list[list[ExpertWeight]] = []
        self.down: list[ExpertWeight] = []

    def set_method(self, method: ExpertsMethod) -> None:
        """Hold the experts quantized by ``method`` (before loading): the dense stacks go."""
        if self.tp.is_parallel:
            raise ValueError(
                f"Quantized experts cannot be split across {self.tp.size} tensor-parallel ranks yet; "
                "use --tensor-parallel-size 1."
            )
        self.method = method
        del self.w13, self.w2

    def _stage(self, expert: int, proj: str, suffix: str, tensor: torch.Tensor) -> bool:
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"Expert {expert} {proj}: the model has {self.num_experts} experts.")
        self._staged.setdefault((expert, proj), {})[suffix] = tensor
        return False  # the weights exist once loading ends (process_weights_after_loading)

    def process_weights_after_loading(self, path: str = "experts") -> None:
        """With a method: every expert projection's staged tensors into the layout, held as
        parameters; a projection the checkpoint did not give is an error naming it."""
        if self.method is None:
            return
        missing = [
            f"{path}.{e}.{proj}"
            for e in range(self.num_experts)
            for proj in PROJECTIONS
            if (e, proj) not in self._staged
        ]
        if missing:
            shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
            raise ValueError(f"The checkpoint did not provide these expert projections: {shown}.")
        i, h = self.intermediate_size, self.hidden_size
        for e in range(self.num_experts):

            def weight(proj: str, out_features: int, in_features: int, e: int = e) -> ExpertWeight:
                tensors = self._staged.pop((e, proj))
                return self.method.expert_weight(tensors, out_features, in_features, f"{path}.{e}.{proj}")

            gate, up = weight("gate_proj", i, h), weight("up_proj", i, h)
            joined = gate.joined(up)
            parts = [joined] if joined is not None else [gate, up]
            self.gate_up.append([part.attach(self, f"_{e}_gate_up_{n}") for n, part in enumerate(parts)])
            self.down.append(weight("down_proj", h, i).attach(self, f"_{e}_down"))

    def _local(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's part of a full-intermediate-size tensor along ``dim``."""
        if not self.tp.is_parallel or tensor.shape[dim] != self.full_intermediate_size:
            return tensor  # whole, or a shape mismatch the caller reports
        return tensor.narrow(dim, self.start, self.intermediate_size)

    def load(self, expert: int, proj: str, tensor: torch.Tensor, suffix: str = "weight") -> bool:
        """One expert's ``gate_proj`` / ``up_proj`` / ``down_proj`` tensor (``weight``, or with a
        method a quantized format's tensor); True once all dense weights are in."""
        if self.method is not None:
            return self._stage(expert, proj, suffix, tensor)
        if suffix != "weight":
            raise ValueError(
                f"Expert {expert} {proj}.{suffix}: a quantized expert tensor, and these experts hold dense "
                f"weights (the checkpoint's quantization method does not compute quantized experts)."
            )
        i = self.intermediate_size
        tensor = dense_tensor(f"experts.{expert}.{proj}", tensor, self.w13.dtype)
        tensor = self._local(tensor, 1 if proj == "down_proj" else 0)
        target = {
            "gate_proj": self.w13.data[expert, :i],
            "up_proj": self.w13.data[expert, i:],
            "down_proj": self.w2.data[expert],
        }[proj]
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(
                f"Expert {expert} {proj}: model expects {tuple(target.shape)}, checkpoint has {tuple(tensor.shape)}."
            )
        target.copy_(tensor)
        self._loaded.add((expert, proj))
        return len(self._loaded) == 3 * self.w13.shape[0]

    def load_fused(self, proj: str, tensor: torch.Tensor) -> bool:
        """transformers' stacked layout: ``gate_up_proj`` [E, 2I, hidden], ``down_proj`` [E, hidden, I]."""
        if self.method is not None:  # dense stacks, quantized expert by expert once loaded
            i = self.intermediate_size
            for e, expert in enumerate(tensor):
                if proj == "gate_up_proj":
                    self._stage(e, "gate_proj", "weight", expert[:i])
                    self._stage(e, "up_proj", "weight", expert[i:])
                else:
                    self._stage(e, "down_proj", "weight", expert)
            return False
        target = self.w13 if proj == "gate_up_proj" else self.w2
        tensor = dense_tensor(f"experts.{proj}", tensor, target.dtype)
        if self.tp.is_parallel and proj == "gate_up_proj" and tensor.dim() == 3:
            gate, up = tensor.chunk(2, dim=1)
            tensor = torch.cat([self._local(gate, 1), self._local(up, 1)], dim=1)
        elif self.tp.is_parallel and tensor.dim() == 3:
            tensor = self._local(tensor, 2)
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(
                f"experts.{proj}: model expects {tuple(target.shape)}, checkpoint has {tuple(tensor.shape)}."
            )
        target.data.copy_(tensor)
        names = ("gate_proj", "up_proj") if proj == "gate_up_proj" else ("down_proj",)
        self._loaded.update((e, n) for e in range(self.w13.shape[0]) for n in names)
        return len(self._loaded) == 3 * self.w13.shape[0]

    def forward(
        self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """x [T, hidden], expert_ids / weights [T, k] -> Σ_k weight · expert(x) [T, hidden]."""
        k = expert_ids.shape[1]
        flat = expert_ids.flatten()
        order = flat.argsort(stable=True)
        token_of = order // k  # the token behind each (token, choice) in expert order
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = order[start : start + count]
            tokens = token_of[start : start + count]
            start += count
            if self.method is not None:
                h = self._quantized_expert(expert, x[tokens], ctx)
            else:
                h = self.activation(x[tokens] @ self.w13[expert].t(), ctx) @ self.w2[expert].t()
            out.index_add_(0, tokens, h.float() * weights.flatten()[rows].unsqueeze(1))
        return self.tp.all_reduce(out).to(x.dtype)

    def _quantized_expert(self, expert: int, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        parts = [part.linear(ctx.ops, x) for part in self.gate_up[expert]]
        gate_up = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        return self.down[expert].linear(ctx.ops, self.activation(gate_up, ctx))

    def activation(self, gate_up: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        if self.custom_activation is not None:
            return self.custom_activation(gate_up)
        if self.swiglu_limit is None:
            return ctx.ops.silu_and_mul(gate_up)
        return clamped_swiglu(gate_up, self.swiglu_limit)


def clamped_swiglu(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """[..., 2d] gate then up -> silu(min(gate, limit)) * clamp(up, -limit, limit)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class MoE(nn.Module):
    """Routed experts (``gate``, ``experts``) plus shared experts (``num_shared_experts`` of
    ``moe_intermediate_size`` fused into one gated MLP), as DeepSeek-V3 and Kimi name them;
    both split over the ranks of ``tp``."""

    def __init__(self, dims: MoEDims, dtype: torch.dtype, *, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.gate = Router(dims)
        self.experts = Experts(dims.num_experts, dims.moe_intermediate_size, dims.hidden_size, dtype, tp=tp)
        self.shared_experts = (
            GatedMLP(dims.hidden_size, dims.moe_intermediate_size * dims.num_shared_experts, False, dtype, tp=tp)
            if dims.num_shared_experts
            else None
        )

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        expert_ids, weights = self.gate(x)
        out = self.experts(x, expert_ids, weights, ctx)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x, ctx)
        return out


def load_named_tensors(
    module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], stacked: dict[str, tuple[str, int]] = GATE_UP_PARAMS
) -> set[str]:
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
            done = (
                experts.load(int(expert.group("expert")), expert.group("proj"), tensor, expert.group("suffix"))
                if expert
                else experts.load_fused(fused.group("proj"), tensor)
            )
            if done:
                loaded.update(f"{match.group('moe')}.{p}" for p in ("w13", "w2"))
            continue
        loaded |= load_tensor(module, params, linears, name, tensor, stacked)
    return loaded


def quantize_experts(model: nn.Module, quantizer: Quantizer) -> list[str]:
    """Give every :class:`Experts` of a model not loaded yet the method ``quantizer`` chooses
    for it (``Quantizer.get_experts_method``); returns their paths."""
    quantized = []
    for path, module in model.named_modules():
        if isinstance(module, Experts):
            method = quantizer.get_experts_method(path)
            if method is not None:
                module.set_method(method)
                quantized.append(path)
    return quantized


def finish_experts(model: nn.Module) -> None:
    """After loading: quantized experts convert what they staged (``process_weights_after_loading``)."""
    for path, module in model.named_modules():
        if isinstance(module, Experts):
            module.process_weights_after_loading(path)
