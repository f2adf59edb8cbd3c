"""``DeepseekV4ForCausalLM``: lays out each layer's KV-cache parts (window, compressed
entries, compressor and indexer states), runs the hyper-connected decoder and loads
either naming scheme of the checkpoints, leaving the ``mtp.*`` block to the ``mtp``
proposer."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from engine.interfaces.attention import SPARSE_MLA, TOKEN_STATE, AttentionSpec
from engine.interfaces.forward_context import ForwardContext
from engine.interfaces.model import Model, ModelInit
from engine.layers.decoder import require_silu
from engine.layers.linear import Linear
from engine.layers.moe import load_named_tensors
from engine_deepseek_v4.chat_v4 import encode_chat
from engine_deepseek_v4.deepseek_v4.attention import CacheLayers
from engine_deepseek_v4.deepseek_v4.checkpoint_names import transformers_name
from engine_deepseek_v4.deepseek_v4.config import CSA, HCA, V4Dims
from engine_deepseek_v4.deepseek_v4.decoder import V4DecoderLayer, V4Stack
from engine_deepseek_v4.deepseek_v4.rope import Rope
from engine_deepseek_v4.deepseek_v4.step import Step

logger = logging.getLogger("engine.deepseek")


class DeepseekV4ForCausalLM(Model):
    chat_encoder = staticmethod(encode_chat)  # V4 ships its prompt format as code (chat_v4.py)
    tool_parser = "deepseek_v4"  # DSML in a <｜DSML｜tool_calls> block
    reasoning_parser = "deepseek_r1"
    provides_pre_head_hidden_states = True  # the streams before hc_head, which its MTP block reads

    def __init__(self, init: ModelInit) -> None:
        super().__init__()
        config, dtype = init.config, init.dtype
        require_silu(config, self)
        d = self.dims = V4Dims.from_config(config)
        if d.num_heads % d.o_groups:
            raise ValueError(f"num_attention_heads={d.num_heads} is not a multiple of o_groups={d.o_groups}.")
        entry = AttentionSpec(SPARSE_MLA, d.num_heads, 1, d.head_dim, d.head_dim**-0.5, latent_size=d.head_dim)
        self.specs: list[AttentionSpec] = []

        def cache_layer(spec: AttentionSpec) -> int:
            self.specs.append(spec)
            return len(self.specs) - 1

        def token_state(size: int) -> AttentionSpec:
            return AttentionSpec(TOKEN_STATE, 1, 1, size, 1.0)

        layers = []
        with torch.device(init.device):
            for i, layer_type in enumerate(d.layer_types):
                parts = {"window": cache_layer(entry)}
                if layer_type == HCA:
                    parts.update(compressed=cache_layer(entry), state=cache_layer(token_state(2 * d.head_dim)))
                elif layer_type == CSA:
                    parts.update(
                        compressed=cache_layer(entry),
                        state=cache_layer(token_state(4 * d.head_dim)),
                        index_state=cache_layer(token_state(4 * d.index_head_dim)),
                        index_keys=cache_layer(token_state(d.index_head_dim)),
                    )
                layers.append(V4DecoderLayer(d, i, CacheLayers(**parts), dtype, tp=init.tp))
            self.model = V4Stack(d, layers, dtype, tp=init.tp)
            self.lm_head = Linear(d.hidden_size, d.vocab_size, False, dtype)
        self.ropes = {
            "main": Rope(d.rope_dim, d.rope_main, d.max_positions),
            "compress": Rope(d.rope_dim, d.rope_compress, d.max_positions),
        }

    def kv_cache_specs(self) -> list[AttentionSpec]:
        return list(self.specs)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        step = Step(input_ids, positions, self.ropes)
        x = self.model.embed_tokens(input_ids)
        streams = x.unsqueeze(1).expand(-1, self.dims.hc_mult, -1).contiguous()  # [T, n, hidden]
        for layer in self.model.layers:
            streams = layer(streams, step, ctx)
        if self.keep_pre_head_hidden_states:
            self.pre_head_hidden_states = streams.flatten(1)  # [T, hc_mult · hidden]
        return self.model.norm(self.model.hc_head(streams))

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        skipped_mtp = 0

        def model_tensors():
            nonlocal skipped_mtp
            for name, tensor in weights:
                name = transformers_name(name)
                if name.startswith("mtp."):
                    skipped_mtp += 1  # the multi-token-prediction block: the mtp proposer's
                    continue
                yield name, tensor

        loaded = load_named_tensors(self, model_tensors())
        if skipped_mtp:
            logger.info("skipped %d multi-token-prediction tensors (mtp.*)", skipped_mtp)
        return loaded
