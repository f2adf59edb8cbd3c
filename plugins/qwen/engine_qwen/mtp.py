"""Qwen3.5's multi-token-prediction block, as the engine's ``mtp`` proposer
(:mod:`engine.spec_decode.mtp`) runs it; ``plugin.py`` registers it as the models
``"<Architecture>.mtp"``.

The checkpoint's ``mtp.*`` tensors (``mtp_num_hidden_layers: 1``, as published): from the
target's final hidden state ``h_t`` (after its last norm) and the embedding ``e`` of token
``t+1``,

    x = fc([pre_fc_norm_embedding(e); pre_fc_norm_hidden(h_t)])      # fc: [hidden, 2 · hidden]
    x = layers.0(x)                                                 # a full-attention decoder layer
    out = norm(x);  logits = lm_head(out)

with zero-centred norms, the model's gated attention on the block's own cache and its MLP
(dense, or experts as the model's layer 0 has them). The embedding and the LM head are the
target's. Drafting further chains ``out``.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from engine.distributed import SINGLE
from engine.interfaces.attention import MHA, AttentionSpec
from engine.interfaces.forward_context import ForwardContext
from engine.layers.linear import Linear, VocabEmbedding
from engine.layers.moe import load_named_tensors
from engine.layers.rotary import RotaryEmbedding, rope_parameters
from engine.model_config import HFConfig
from engine.spec_decode.mtp import MtpModule
from engine_qwen.qwen3_5 import (
    STACKED,
    DecoderLayer,
    Dims,
    GatedAttention,
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3NextForCausalLM,
    ZeroCenteredRMSNorm,
)


class Qwen3_5Mtp(MtpModule):
    """Whole, as the proposer runs on one rank (the engine refuses speculation with more than one)."""

    config_key = "mtp_num_hidden_layers"
    shared_tensors = {"model.embed_tokens.weight": "embed_tokens.weight", "lm_head.weight": "lm_head.weight"}
    target_class = Qwen3_5ForCausalLM  # whose make_mlp gives the block's MLPs

    @classmethod
    def checkpoint_prefix(cls, config: HFConfig) -> str:
        return "mtp."

    def __init__(self, config: HFConfig, dtype: torch.dtype) -> None:
        super().__init__()
        d = self.dims = Dims.from_config(config)
        self.spec = AttentionSpec(MHA, d.num_heads, d.num_kv_heads, d.head_dim, d.head_dim**-0.5)
        num_layers = int(config.get(self.config_key) or 1)
        if num_layers != 1:  # which layer serves which draft is unsettled with more: refuse rather than guess
            raise ValueError(
                f"The checkpoint's {self.config_key} is {num_layers}: the mtp proposer runs Qwen MTP blocks of "
                f"one layer. Use another --speculative-method for this checkpoint."
            )
        # the layer's attention is the only layer of the block's own cache
        self.layers = nn.ModuleList(
            [
                DecoderLayer(
                    GatedAttention(d, self.spec, 0, dtype, SINGLE),
                    self.target_class.make_mlp(config, d, 0, dtype, SINGLE),
                    d,
                    dtype,
                )
            ]
        )
        self.embed_tokens = VocabEmbedding(d.vocab_size, d.hidden_size, dtype, tp=SINGLE)
        self.pre_fc_norm_embedding = ZeroCenteredRMSNorm(d.hidden_size, d.eps, dtype)
        self.pre_fc_norm_hidden = ZeroCenteredRMSNorm(d.hidden_size, d.eps, dtype)
        self.fc = Linear(2 * d.hidden_size, d.hidden_size, False, dtype)
        self.norm = ZeroCenteredRMSNorm(d.hidden_size, d.eps, dtype)
        self.lm_head = Linear(d.hidden_size, d.vocab_size, False, dtype)
        if config.get("tie_word_embeddings", False):
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(d.head_dim, d.max_positions, rope_parameters(config), rotary_dim=d.rotary_dim)
        self.max_positions = d.max_positions

    def kv_cache_specs(self) -> list[AttentionSpec]:
        return [self.spec]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids [T] (the token after each hidden state's position), positions [T];
        ``previous_hidden`` [T, hidden] -> the block's normed output [T, hidden]."""
        e = self.pre_fc_norm_embedding(self.embed_tokens(input_ids))
        h = self.pre_fc_norm_hidden(self.previous_hidden.to(e.dtype))
        x = self.fc(torch.cat([e, h], dim=-1))
        cos_sin = self.rotary.cos_sin(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, ctx, cos_sin)
        return self.norm(x)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Tensors named as in the checkpoint after ``mtp.``, and the target's embedding and head."""
        tied = self.lm_head.weight is self.embed_tokens.weight
        return load_named_tensors(
            self,
            (
                (name.replace(".self_attn.", ".mixer."), tensor)
                for name, tensor in weights
                if not (tied and name == "lm_head.weight")
            ),
            STACKED,
        )


class Qwen3_5MoeMtp(Qwen3_5Mtp):
    target_class = Qwen3_5MoeForCausalLM


class Qwen3NextMtp(Qwen3_5Mtp):
    target_class = Qwen3NextForCausalLM


MULTIMODAL_SHARED_TENSORS = {
    "model.language_model.embed_tokens.weight": "embed_tokens.weight",
    "lm_head.weight": "lm_head.weight",
}


class Qwen3_5MultimodalMtp(Qwen3_5Mtp):
    """The block of a published (multimodal) checkpoint: its config under ``text_config``, the
    target's embedding under ``model.language_model.``."""

    shared_tensors = MULTIMODAL_SHARED_TENSORS

    @classmethod
    def module_config(cls, config: HFConfig) -> HFConfig:
        return HFConfig(config.to_dict().get("text_config") or {})


class Qwen3_5MoeMultimodalMtp(Qwen3_5MultimodalMtp):
    target_class = Qwen3_5MoeForCausalLM
