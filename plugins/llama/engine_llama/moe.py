"""Llama-family mixtures of experts: Qwen3-MoE and Mixtral.

Both keep their family's attention (Qwen3's per-head q/k norm, Mistral's sliding window) and
replace the MLP by routed experts: a softmax over the experts' router logits in float32, the
top ``num_experts_per_tok`` taken, renormalised to sum to one (Mixtral always, Qwen3-MoE with
``norm_topk_prob``), each a gated SiLU MLP of the expert size. There is no shared expert.

Checkpoints name the experts per expert (``mlp.experts.E.gate_proj`` / ``up_proj`` /
``down_proj``; Mixtral's ``block_sparse_moe.experts.E.w1`` / ``w3`` / ``w2``) or, as
transformers 5 holds them in memory, stacked (``mlp.experts.gate_up_proj`` [E, 2I, hidden],
``mlp.experts.down_proj`` [E, hidden, I]); both load into ``engine.layers.moe.Experts``.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Iterable

import torch
from torch import nn

from engine.distributed import TensorParallel
from engine.layers.moe import Experts, SoftmaxRouter, load_named_tensors
from engine.model_config import HFConfig

from .model import STACKED_PARAMS, Dims, LlamaForCausalLM, Variant

if TYPE_CHECKING:
    from engine.interfaces.forward_context import ForwardContext

# Mixtral's names of an expert's projections, and of its MoE block
MIXTRAL_EXPERT = re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.")
MIXTRAL_PROJECTIONS = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


class SparseMoE(nn.Module):
    """``gate`` (the router) and ``experts``, as transformers names them; under tensor
    parallelism every rank holds its part of every expert (``engine.layers.moe.Experts``)."""

    def __init__(
        self,
        num_experts: int,
        intermediate_size: int,
        hidden_size: int,
        k: int,
        dtype: torch.dtype,
        tp: TensorParallel,
        *,
        normalize: bool,
        round_weights: bool,
    ) -> None:
        super().__init__()
        if not 0 < k <= num_experts:
            raise ValueError(
                f"num_experts_per_tok is {k}, the model has {num_experts} experts: the config must route each "
                f"token to between 1 and {num_experts} experts."
            )
        self.gate = SoftmaxRouter(num_experts, hidden_size, k, normalize, dtype, round_weights=round_weights)
        self.experts = Experts(num_experts, intermediate_size, hidden_size, dtype, tp=tp)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        expert_ids, weights = self.gate(x)
        return self.experts(x, expert_ids, weights, ctx)


class LlamaMoEModel(LlamaForCausalLM):
    """Loading for the MoE variants: the routed experts' tensors per expert or stacked."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_named_tensors(self, self.checkpoint_tensors(weights), STACKED_PARAMS)


class Qwen3MoeForCausalLM(LlamaMoEModel):
    """Qwen3's attention; routed experts (``num_experts`` of ``moe_intermediate_size``) in the
    layers ``decoder_sparse_step`` picks and ``mlp_only_layers`` leaves out, a dense MLP of
    ``intermediate_size`` in the others; a sliding window on every layer when
    ``use_sliding_window``."""

    variant = Variant(qk_norm=True, sliding_window="use_sliding_window")
    tool_parser = "hermes"
    reasoning_parser = "qwen3"

    def make_mlp(self, config: HFConfig, dims: Dims, index: int, dtype: torch.dtype, tp: TensorParallel) -> nn.Module:
        # transformers 5 writes num_local_experts, the published configs num_experts
        num_experts = int(config.get("num_experts", config.get("num_local_experts", 0)))
        sparse = (
            num_experts > 0
            and index not in (config.get("mlp_only_layers") or ())
            and (index + 1) % int(config.get("decoder_sparse_step", 1)) == 0
        )
        if not sparse:
            return super().make_mlp(config, dims, index, dtype, tp)
        return SparseMoE(
            num_experts,
            int(config.moe_intermediate_size),
            dims.hidden_size,
            int(config.num_experts_per_tok),
            dtype,
            tp,
            normalize=bool(config.get("norm_topk_prob", False)),
            round_weights=True,
        )


class MixtralForCausalLM(LlamaMoEModel):
    """Mistral's attention; every MLP ``num_local_experts`` routed experts of
    ``intermediate_size``, ``num_experts_per_tok`` (two) a token, their weights renormalised."""

    variant = Variant(qkv_bias=False, o_bias=False, sliding_window="all")
    tool_parser = "mistral"

    def make_mlp(self, config: HFConfig, dims: Dims, index: int, dtype: torch.dtype, tp: TensorParallel) -> nn.Module:
        return SparseMoE(
            int(config.num_local_experts),
            dims.intermediate_size,
            dims.hidden_size,
            int(config.get("num_experts_per_tok", 2)),
            dtype,
            tp,
            normalize=True,
            round_weights=False,
        )

    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        for name, tensor in super().checkpoint_tensors(weights):
            name = MIXTRAL_EXPERT.sub(lambda m: f".mlp.experts.{m[1]}.{MIXTRAL_PROJECTIONS[m[2]]}.", name)
            yield name.replace(".block_sparse_moe.", ".mlp."), tensor
