"""DeepSeek's multi-token-prediction blocks, as the engine's ``mtp`` proposer
(:mod:`engine.spec_decode.mtp`) runs them; ``plugin.py`` registers them as the models
``"<Architecture>.mtp"``.

V3 / V3.2's MTP layer (``model.layers.{num_hidden_layers}.*``) predicts the token after next:
from the target's final hidden state ``h_t`` and the embedding of token ``t+1`` it computes
``eh_proj([enorm(emb); hnorm(h_t)])``, runs one decoder layer (MLA + experts) over it and reads
logits through ``shared_head``; drafting further chains the layer's own output. DeepSeek-V4's
block (``mtp.0.*``, see ``deepseek_v4.MtpV4Layer``) reads the target's hyper-connection
streams before its head instead (``PRE_HEAD_HIDDEN_STATES``) and chains its own streams.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.distributed import SINGLE
from engine.interfaces.spec_proposer import PRE_HEAD_HIDDEN_STATES
from engine.layers.layernorm import RMSNorm
from engine.layers.linear import Linear, VocabEmbedding
from engine.layers.moe import load_named_tensors
from engine.layers.rotary import RotaryEmbedding, rope_parameters
from engine.model_config import HFConfig
from engine.spec_decode.mtp import MtpModule
from engine_deepseek_v4.deepseek_v3 import Dims, attention_spec, decoder_layer, indexer_spec
from engine_deepseek_v4.deepseek_v4 import MtpV4Layer

SPARSE_ARCHITECTURE = "DeepseekV32ForCausalLM"
# the target's tensors V4's MTP block shares, under the names its loader takes
V4_SHARED_TENSORS = {
    "embed.weight": "embed.weight",
    "model.embed_tokens.weight": "embed.weight",
    "head.weight": "head.weight",
    "lm_head.weight": "head.weight",
}

LAYER_PARTS = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")  # of the decoder layer


class SharedHead(nn.Module):
    def __init__(self, dims: Dims, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm = RMSNorm(dims.hidden_size, dims.rms_norm_eps, dtype)
        self.head = Linear(dims.hidden_size, dims.vocab_size, False, dtype)


class MtpLayer(MtpModule):
    """V3 / V3.2's multi-token-prediction layer, named as in the checkpoint below its prefix; whole,
    as the proposer runs on one rank (the engine refuses speculation with more than one)."""

    config_key = "num_nextn_predict_layers"

    @classmethod
    def checkpoint_prefix(cls, config: HFConfig) -> str:
        return f"model.layers.{config.num_hidden_layers}."

    def __init__(self, config: HFConfig, dtype: torch.dtype) -> None:
        super().__init__()
        d = Dims.from_config(config)
        # V3.2's MTP layer has sparse attention too: an indexer, its keys the cache's second layer
        self.sparse_attention = SPARSE_ARCHITECTURE in (config.get("architectures") or ())
        self.dims = d = d.with_indexer(config) if self.sparse_attention else d
        rope = rope_parameters(config)
        self.spec = attention_spec(d, rope, tp=SINGLE)
        # the MTP layer follows the main ones (dense or experts by the same rule); its attention is
        # the only one of its own cache
        self.layer = decoder_layer(
            d,
            self.spec,
            d.num_layers,
            0,
            bool(config.get("rope_interleave", True)),
            dtype,
            1 if self.sparse_attention else None,
            tp=SINGLE,
        )
        self.embed_tokens = VocabEmbedding(d.vocab_size, d.hidden_size, dtype, tp=SINGLE)
        self.enorm = RMSNorm(d.hidden_size, d.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(d.hidden_size, d.rms_norm_eps, dtype)
        self.eh_proj = Linear(2 * d.hidden_size, d.hidden_size, False, dtype)
        self.shared_head = SharedHead(d, dtype)
        self.rotary = RotaryEmbedding(d.qk_rope_head_dim, int(config.get("max_position_embeddings", 4096)), rope)
        self.previous_hidden: torch.Tensor | None = None  # set before each forward

    def kv_cache_specs(self):
        return [self.spec, indexer_spec(self.dims)] if self.sparse_attention else [self.spec]

    @property
    def max_positions(self) -> int:
        return self.rotary.max_positions

    def forward(self, input_ids, positions, ctx):
        """input_ids [T] (the token after each hidden state's position), positions [T];
        ``previous_hidden`` [T, hidden] -> the layer's hidden states [T, hidden]."""
        e = self.enorm(self.embed_tokens(input_ids), ops=ctx.ops)
        h = self.hnorm(self.previous_hidden.to(e.dtype), ops=ctx.ops)
        x = self.eh_proj(torch.cat([e, h], dim=-1))
        out, residual = self.layer(x, None, ctx, self.rotary.cos_sin(positions, x.dtype))
        return out + residual

    def compute_logits(self, hidden_states):
        return self.shared_head.head(self.shared_head.norm(hidden_states))

    def load_weights(self, weights):
        """Tensors named as in the checkpoint after ``model.layers.{num_hidden_layers}.``."""
        return load_named_tensors(
            self, ((f"layer.{n}" if n.split(".")[0] in LAYER_PARTS else n, t) for n, t in weights)
        )


class MtpV4Module(MtpV4Layer, MtpModule):
    """V4's block (:class:`MtpV4Layer`) as the proposer builds it: ``mtp.0.*``, reading the
    target's streams before its head, with the target's embedding and head."""

    config_key = "num_nextn_predict_layers"
    hidden_state_layer = PRE_HEAD_HIDDEN_STATES
    shared_tensors = V4_SHARED_TENSORS

    @classmethod
    def checkpoint_prefix(cls, config: HFConfig) -> str:
        return "mtp.0."
