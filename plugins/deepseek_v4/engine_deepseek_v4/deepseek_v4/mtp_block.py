"""DeepSeek-V4's multi-token-prediction block (``mtp.0.*``) as a model of its own, which the
engine's ``mtp`` proposer (``engine.spec_decode.mtp``) builds, loads and drafts with. It is built of
V4's own layers, so it sits with them; V3's MTP layer is ``mtp.MtpLayer``."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from engine.distributed import SINGLE
from engine.interfaces.attention import SPARSE_MLA, AttentionSpec
from engine.interfaces.forward_context import ForwardContext
from engine.interfaces.model import Model
from engine.layers.linear import Linear, VocabEmbedding
from engine.layers.moe import load_named_tensors
from engine.model_config import HFConfig
from engine_deepseek_v4.deepseek_v4.attention import CacheLayers
from engine_deepseek_v4.deepseek_v4.checkpoint_names import transformers_name
from engine_deepseek_v4.deepseek_v4.config import SLIDING, V4Dims
from engine_deepseek_v4.deepseek_v4.decoder import V4DecoderLayer
from engine_deepseek_v4.deepseek_v4.hyper_connections import HyperHead
from engine_deepseek_v4.deepseek_v4.norms import Fp32RMSNorm
from engine_deepseek_v4.deepseek_v4.rope import Rope
from engine_deepseek_v4.deepseek_v4.step import Step


class MtpV4Layer(Model):
    """DeepSeek-V4's multi-token-prediction block (``mtp.0.*`` of the reference checkpoints),
    read as the ``mtp`` proposer runs it.

    From the target's hyper-connection streams ``h`` [n, hidden] before its ``hc_head`` and
    the embedding ``e`` of the next token, the streams ``e_proj(enorm(e)) + h_proj(hnorm(h_k))``
    (every stream k) go through one decoder block (sliding-window attention, experts routed
    by score), its own ``hc_head`` and ``norm``, and the target's LM head. Drafting further
    chains the block's output streams. The embedding and the head are the target's. Whole:
    the proposer runs on one rank (the engine refuses speculation with more than one).
    """

    provides_pre_head_hidden_states = True

    def __init__(self, config: HFConfig, dtype: torch.dtype) -> None:
        super().__init__()
        from dataclasses import replace

        d = V4Dims.from_config(config)
        self.dims = d = replace(d, layer_types=(SLIDING,), mlp_layer_types=("moe",))
        self.spec = AttentionSpec(SPARSE_MLA, d.num_heads, 1, d.head_dim, d.head_dim**-0.5, latent_size=d.head_dim)
        self.embed_tokens = VocabEmbedding(d.vocab_size, d.hidden_size, dtype, tp=SINGLE)
        self.enorm = Fp32RMSNorm(d.hidden_size, d.rms_norm_eps)
        self.hnorm = Fp32RMSNorm(d.hidden_size, d.rms_norm_eps)
        self.e_proj = Linear(d.hidden_size, d.hidden_size, False, dtype)
        self.h_proj = Linear(d.hidden_size, d.hidden_size, False, dtype)
        self.block = V4DecoderLayer(d, 0, CacheLayers(window=0), dtype, tp=SINGLE)
        self.hc_head = HyperHead(d)
        self.norm = Fp32RMSNorm(d.hidden_size, d.rms_norm_eps)
        self.lm_head = Linear(d.hidden_size, d.vocab_size, False, dtype)
        self.ropes = {"main": Rope(d.rope_dim, d.rope_main, d.max_positions)}
        self.max_positions = d.max_positions
        self.previous_hidden: torch.Tensor | None = None  # [T, n · hidden], set before each forward
        self.cache_positions: torch.Tensor | None = None  # [T] cache slots' positions, set with it
        self.pre_head_hidden_states: torch.Tensor | None = None

    def kv_cache_specs(self) -> list[AttentionSpec]:
        return [self.spec]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        d, num_tokens = self.dims, input_ids.shape[0]
        e = self.e_proj(self.enorm(self.embed_tokens(input_ids)))  # [T, hidden]
        h = self.previous_hidden.to(e.dtype).reshape(num_tokens * d.hc_mult, d.hidden_size)
        streams = e.unsqueeze(1) + self.h_proj(self.hnorm(h)).view(num_tokens, d.hc_mult, d.hidden_size)
        streams = self.block(streams, Step(input_ids, positions, self.ropes, self.cache_positions), ctx)
        self.pre_head_hidden_states = streams.flatten(1)
        return self.norm(self.hc_head(streams))

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)

    def chain_hidden(self, out: torch.Tensor) -> torch.Tensor:
        """What the next draft reads as its previous hidden state: the block's output streams."""
        return self.pre_head_hidden_states

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Tensors named as in the checkpoint after ``mtp.0.``, plus the target's ``embed`` and
        ``head`` under those names."""

        def renamed():
            for name, tensor in weights:
                if name in ("embed.weight", "head.weight"):
                    yield ("embed_tokens.weight" if name == "embed.weight" else "lm_head.weight"), tensor
                elif name.startswith("hc_head_"):
                    yield "hc_head.hc_" + name.removeprefix("hc_head_"), tensor
                elif name.split(".")[0] in ("enorm", "hnorm", "e_proj", "h_proj", "norm"):
                    yield name, tensor
                else:  # the decoder block, named as a reference layer
                    yield "block." + transformers_name("layers.0." + name).removeprefix("model.layers.0."), tensor

        return load_named_tensors(self, renamed())
