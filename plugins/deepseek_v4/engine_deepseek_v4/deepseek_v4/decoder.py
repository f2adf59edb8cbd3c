"""DeepSeek-V4's decoder: a layer (attention and experts, each between two
hyper-connections) and ``V4Stack``, the checkpoint's ``model.*`` module holding the
embedding, the layers, ``hc_head`` and the final norm."""

from __future__ import annotations

import torch
from torch import nn

from engine.distributed import TensorParallel
from engine.interfaces.forward_context import ForwardContext
from engine.layers.linear import VocabEmbedding
from engine_deepseek_v4.deepseek_v4.attention import CacheLayers, V4Attention
from engine_deepseek_v4.deepseek_v4.config import V4Dims
from engine_deepseek_v4.deepseek_v4.hyper_connections import HyperConnection, HyperHead, hyper_residual
from engine_deepseek_v4.deepseek_v4.moe import V4MoE
from engine_deepseek_v4.deepseek_v4.norms import Fp32RMSNorm
from engine_deepseek_v4.deepseek_v4.step import Step


class V4DecoderLayer(nn.Module):
    def __init__(
        self, dims: V4Dims, index: int, layers: CacheLayers, dtype: torch.dtype, *, tp: TensorParallel
    ) -> None:
        super().__init__()
        self.self_attn = V4Attention(dims, dims.layer_types[index], layers, dtype)
        self.mlp = V4MoE(dims, dims.mlp_layer_types[index] == "hash_moe", dtype, tp=tp)
        self.input_layernorm = Fp32RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.post_attention_layernorm = Fp32RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.attn_hc = HyperConnection(dims)
        self.ffn_hc = HyperConnection(dims)

    def forward(self, streams: torch.Tensor, step: Step, ctx: ForwardContext) -> torch.Tensor:
        post, comb, collapsed = self.attn_hc(streams)
        streams = hyper_residual(streams, self.self_attn(self.input_layernorm(collapsed), step, ctx), post, comb)
        post, comb, collapsed = self.ffn_hc(streams)
        return hyper_residual(
            streams, self.mlp(self.post_attention_layernorm(collapsed), step.input_ids, ctx), post, comb
        )


class V4Stack(nn.Module):
    """``model.*`` of the checkpoint: embedding, layers, ``hc_head`` and the final norm."""

    def __init__(self, dims: V4Dims, layers: list[V4DecoderLayer], dtype: torch.dtype, *, tp: TensorParallel) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(dims.vocab_size, dims.hidden_size, dtype, tp=tp)
        self.layers = nn.ModuleList(layers)
        self.hc_head = HyperHead(dims)
        self.norm = Fp32RMSNorm(dims.hidden_size, dims.rms_norm_eps)
