"""DeepSeek-V3 (and Kimi-K2, the same architecture): multi-head latent attention and a
routed mixture of experts with shared experts; DeepSeek-V3.2, the same network with
DeepSeek sparse attention.

MLA (``engine.layers.mla``) runs in the absorbed form in prefill and decode alike; the
experts and their router are ``engine.layers.moe``'s, which Kimi's models share.

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
import torch.nn.functional as F
from torch import nn

from engine.distributed import TensorParallel
from engine.interfaces.attention import INDEXER, MLA, SPARSE_MLA, AttentionSpec
from engine.interfaces.forward_context import ForwardContext
from engine.interfaces.model import Model, ModelInit
from engine.layers.decoder import DecoderStack, GatedMLP, PreNormDecoderLayer, require_silu
from engine.layers.linear import Linear, ParallelLMHead, gather_argmax, gather_logits
from engine.layers.mla import MLADims, MLAttention
from engine.layers.moe import MoE, MoEDims, load_named_tensors
from engine.layers.rotary import RotaryEmbedding, rope_parameters, yarn_mscale
from engine.model_config import HFConfig

logger = logging.getLogger("engine.deepseek")


@dataclass(frozen=True)
class Dims(MLADims, MoEDims):
    """MLA's and the routed experts' sizes, and the rest of the network's."""

    intermediate_size: int
    first_k_dense_replace: int
    vocab_size: int
    num_layers: int
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
        return replace(
            self,
            index_n_heads=int(config.get("index_n_heads", 64)),
            index_head_dim=head_dim,
            index_topk=int(config.get("index_topk", 2048)),
        )

    def is_moe(self, layer_index: int) -> bool:
        """Whether layer ``layer_index`` routes experts (``mlp_layer_types`` when listed, else
        every layer from ``first_k_dense_replace`` on; multi-token-prediction layers do)."""
        if self.mlp_layer_types is not None and layer_index < len(self.mlp_layer_types):
            return self.mlp_layer_types[layer_index] == "sparse"
        return layer_index >= self.first_k_dense_replace


def softmax_scale(dims: Dims, rope: dict) -> float:
    """qk_head_dim^-½, times YaRN's mscale² when the rope is scaled with ``mscale_all_dim``."""
    scale = dims.qk_head_dim**-0.5
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        mscale = yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"]))
        scale *= mscale * mscale
    return scale


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

    def forward(
        self, x: torch.Tensor, q_latent: torch.Tensor, ctx: ForwardContext, cos_sin: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor | None:
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
    return AttentionSpec(
        kind=INDEXER,
        num_heads=dims.index_n_heads,
        num_kv_heads=1,
        head_size=dims.index_head_dim,
        scale=dims.index_head_dim**-0.5,
        index_topk=dims.index_topk,
    )


def attention_spec(dims: Dims, rope: dict, *, tp: TensorParallel) -> AttentionSpec:
    """The KV-cache spec of the MLA layers (sparse MLA when the dims have an indexer) on a rank of ``tp``."""
    return AttentionSpec(  # this rank's heads; every rank caches the whole latent
        kind=MLA if dims.index_topk is None else SPARSE_MLA,
        num_heads=tp.split(dims.num_heads, "num_attention_heads")[1],
        num_kv_heads=1,
        head_size=dims.kv_lora_rank + dims.qk_rope_head_dim,
        scale=softmax_scale(dims, rope),
        latent_size=dims.kv_lora_rank,
    )


class DeepseekV3ForCausalLM(Model):
    sparse_attention = False  # V3.2: an indexer in every layer
    tool_parser = "deepseek_v3"  # V3 and R1; V3.1 checkpoints (same architecture) need deepseek_v31
    reasoning_parser = "deepseek_r1"
    supports_tensor_parallel = True

    def __init__(self, init: ModelInit) -> None:
        super().__init__()
        config, dtype, tp = init.config, init.dtype, init.tp
        require_silu(config, self)
        d = Dims.from_config(config)
        self.dims = d = d.with_indexer(config) if self.sparse_attention else d
        rope = rope_parameters(config)
        self.spec = attention_spec(d, rope, tp=tp)
        self.num_mtp_layers = int(config.get("num_nextn_predict_layers", 0) or 0)
        interleaved = bool(config.get("rope_interleave", True))
        n = d.num_layers
        with torch.device(init.device):
            # the indexers' keys are KV-cache layers n .. 2n - 1
            layers = [
                decoder_layer(d, self.spec, i, i, interleaved, dtype, n + i if self.sparse_attention else None, tp=tp)
                for i in range(n)
            ]
            self.model = DecoderStack(d.vocab_size, d.hidden_size, d.rms_norm_eps, layers, dtype, tp=tp)
            self.rotary = RotaryEmbedding(d.qk_rope_head_dim, int(config.get("max_position_embeddings", 4096)), rope)
            self.tie_word_embeddings = bool(config.get("tie_word_embeddings", False))
            self.lm_head = ParallelLMHead(d.hidden_size, d.vocab_size, dtype, tp=tp)
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
        return gather_logits(self.lm_head, hidden_states)

    def compute_greedy_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return gather_argmax(self.lm_head, hidden_states)

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
    supports_tensor_parallel = False  # its indexer is not sharded yet
    tool_parser = "deepseek_v32"  # DSML in a <｜DSML｜function_calls> block


def decoder_layer(
    dims: Dims,
    spec: AttentionSpec,
    layer_index: int,
    attention_index: int,
    interleaved_rope: bool,
    dtype: torch.dtype,
    index_layer: int | None = None,
    *,
    tp: TensorParallel,
) -> PreNormDecoderLayer:
    """Decoder layer ``layer_index`` of the network (a dense MLP or routed experts, see
    :meth:`Dims.is_moe`), its attention at ``attention_index`` of the KV-cache specs and, for
    sparse MLA, its indexer's keys at ``index_layer``; this rank's part of it under ``tp``."""
    mlp = (
        MoE(dims, dtype, tp=tp)
        if dims.is_moe(layer_index)
        else GatedMLP(dims.hidden_size, dims.intermediate_size, False, dtype, tp=tp)
    )
    indexer = Indexer(dims, index_layer, dtype) if spec.kind == SPARSE_MLA else None
    return PreNormDecoderLayer(
        MLAttention(dims, spec, attention_index, interleaved_rope, dtype, indexer, tp=tp),
        mlp,
        dims.hidden_size,
        dims.rms_norm_eps,
        dtype,
    )
