"""``mtp``: speculative drafts from a DeepSeek checkpoint's multi-token-prediction layer.

The MTP layer (``model.layers.{num_hidden_layers}.*``) predicts the token after next:
from the target's final hidden state ``h_t`` and the embedding of token ``t+1`` it
computes ``eh_proj([enorm(emb); hnorm(h_t)])``, runs one decoder layer (MLA + experts)
over it and reads logits through ``shared_head``. Drafting k tokens chains it: each
draft's embedding and the layer's own output hidden state give the next. DeepSeek-V4's
block (``mtp.0.*``, see ``deepseek_v4.MtpV4Layer``) reads the target's hyper-connection
streams before its head instead (``PRE_HEAD_HIDDEN_STATES``) and chains its own streams.

The layer keeps its own paged latent cache. Each target request has a shadow request
whose entries are the positions the MTP layer has processed since the request started
decoding (prompt positions are never run through it), in order; rope uses the real
positions. Before drafting, the shadow keeps the longest run of entries whose tokens
the target still has at those positions, so rejected drafts roll back.

Settings (``--speculative-config``): ``kv_cache_memory`` (GiB for the layer's cache,
default 0.25).
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import torch
from torch import nn

from engine.distributed import SINGLE
from engine.interfaces.model import Model
from engine.interfaces.spec_proposer import (
    FINAL_HIDDEN_STATES,
    PRE_HEAD_HIDDEN_STATES,
    DraftRequest,
    Drafts,
    ProposerInit,
    SpecProposer,
)
from engine.layers.layernorm import RMSNorm
from engine.layers.linear import Linear, VocabEmbedding
from engine.layers.moe import load_named_tensors
from engine.layers.rotary import RotaryEmbedding, rope_parameters
from engine.model_config import HFConfig
from engine.model_loader.dequant import CheckpointDequantizer, dequantizable, dequantize_stream
from engine_deepseek_v4.deepseek_v3 import Dims, attention_spec, decoder_layer, indexer_spec

SPARSE_ARCHITECTURE = "DeepseekV32ForCausalLM"
V4_ARCHITECTURE = "DeepseekV4ForCausalLM"
# the target's tensors V4's MTP block shares, under the names its loader takes
V4_SHARED_TENSORS = {
    "embed.weight": "embed.weight",
    "model.embed_tokens.weight": "embed.weight",
    "head.weight": "head.weight",
    "lm_head.weight": "head.weight",
}

LAYER_PARTS = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")  # of the decoder layer

SETTINGS = ("kv_cache_memory",)


class SharedHead(nn.Module):
    def __init__(self, dims: Dims, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm = RMSNorm(dims.hidden_size, dims.rms_norm_eps, dtype)
        self.head = Linear(dims.hidden_size, dims.vocab_size, False, dtype)


class MtpLayer(Model):
    """One multi-token-prediction layer, named as in the checkpoint below its prefix; whole, as
    the proposer runs on one rank (the engine refuses speculation with more than one)."""

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

    def chain_hidden(self, out: torch.Tensor) -> torch.Tensor:
        """What the next draft reads as its previous hidden state: the layer's output."""
        return out

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


class MtpProposer(SpecProposer):
    name = "mtp"
    hidden_state_layers = (FINAL_HIDDEN_STATES,)

    def __init__(self, init: ProposerInit) -> None:
        super().__init__(init)
        from safetensors import safe_open

        from engine.model_loader.checkpoint import safetensors_files
        from engine.model_loader.weights import load_tensors
        from engine.runtime.kv_cache_manager import KVCacheManager
        from engine.runtime.model_builder import build_kv_cache
        from engine.runtime.model_runner import ModelRunner

        unknown = sorted(set(init.config) - set(SETTINGS))
        if unknown:
            raise ValueError(f"mtp takes {', '.join(SETTINGS)}; unknown: {', '.join(unknown)}.")
        memory = init.config.get("kv_cache_memory", 0.25)
        raw = json.loads((init.target_model_path / "config.json").read_text(encoding="utf-8"))
        config = HFConfig(raw)
        v4 = V4_ARCHITECTURE in (raw.get("architectures") or ())
        prefix = "mtp.0." if v4 else f"model.layers.{config.num_hidden_layers}."
        files = safetensors_files(init.target_model_path)
        present = False
        for path in files:
            with safe_open(str(path), framework="pt", device="cpu") as handle:
                present = present or any(name.startswith(prefix) for name in handle.keys())
        if not raw.get("num_nextn_predict_layers") or not present:
            raise ValueError(
                f"The checkpoint at {init.target_model_path} has no multi-token-prediction layer "
                f"(num_nextn_predict_layers is {raw.get('num_nextn_predict_layers')!r}; tensors {prefix}*: "
                f"{'present' if present else 'none'}): --speculative-method mtp needs one."
            )
        if v4:  # reads the target's streams before its head; shares its embedding and head
            from engine_deepseek_v4.deepseek_v4 import MtpV4Layer

            self.layer = MtpV4Layer(config, init.dtype).to(init.device).eval()
            self.hidden_state_layers = (PRE_HEAD_HIDDEN_STATES,)
        else:
            self.layer = MtpLayer(config, init.dtype).to(init.device).eval()
        shared = V4_SHARED_TENSORS if v4 else {}

        def mtp_tensors():
            for path in files:
                with safe_open(str(path), framework="pt", device="cpu") as handle:
                    for name in handle.keys():
                        if name.startswith(prefix):
                            yield name[len(prefix) :], handle.get_tensor(name)
                        elif name in shared:
                            yield shared[name], handle.get_tensor(name)

        tensors = mtp_tensors()
        quantization = raw.get("quantization_config") or {}
        if quantization and dequantizable(quantization):  # an FP8 checkpoint: as the target loads it
            tensors = dequantize_stream(tensors, CheckpointDequantizer(quantization, init.dtype))
        load_tensors(self.layer, tensors)
        dtype_name = str(init.dtype).removeprefix("torch.")
        self.kv_cache = build_kv_cache(
            self.layer,
            init.components,
            init.platform,
            dtype_name,
            init.device,
            init.block_size,
            int(memory * 2**30),
            max_model_len=self.layer.max_positions,
            max_num_seqs=256,
        )
        self.kv_manager = KVCacheManager(self.kv_cache.num_blocks, init.block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(self.layer, self.kv_cache, init.device)
        self.shadows: dict[str, tuple[Any, int]] = {}  # request id -> (shadow request, its first real position)

    def _sync(self, request: DraftRequest) -> Any:
        """The shadow for ``request``: entries for positions first .. first + n - 1 whose tokens
        still agree with the target's; positions past them are dropped."""
        from engine.runtime.request import Request
        from engine.sampling_params import SamplingParams

        tokens = request.token_ids
        newest = len(tokens) - 1  # the position this round processes first
        found = self.shadows.get(request.request_id)
        if found is not None:
            shadow, first = found
            keep = 0
            while (
                keep < shadow.num_computed_tokens
                and first + keep < newest
                and shadow.token_ids[keep] == tokens[first + keep]
            ):
                keep += 1
            if keep:
                shadow.token_ids = shadow.token_ids[:keep]
                shadow.num_computed_tokens = keep
                if first + keep == newest:
                    return shadow, first
            self.kv_manager.free(shadow)  # a gap before the newest token (or nothing kept): start afresh
        shadow = Request(request.request_id, [tokens[-1]], SamplingParams(temperature=0.0))
        shadow.token_ids, shadow.num_computed_tokens = [], 0
        self.shadows[request.request_id] = (shadow, newest)
        return shadow, newest

    @torch.inference_mode()
    def propose(self, requests: Sequence[DraftRequest], num_tokens: int, hidden_states=None) -> Drafts:
        hidden = hidden_states[self.hidden_state_layers[0]]  # [B, ...]: the target's, for each newest token
        drafts: list[list[int]] = [[] for _ in requests]
        states = [self._sync(r) for r in requests]
        # step 0 processes each request's newest token; step j > 0 its previous draft
        inputs = [r.token_ids[-1] for r in requests]
        previous = list(hidden)
        active = list(range(len(requests)))
        for _ in range(num_tokens):
            rows = []
            for i in active:
                shadow, first = states[i]
                position = first + len(shadow.token_ids)
                if position >= self.layer.max_positions or not self.kv_manager.allocate(shadow, 1):
                    continue
                shadow.token_ids.append(inputs[i])
                rows.append((i, position))
            if not rows:
                break
            out = self._run(
                [states[i][0] for i, _ in rows],
                torch.tensor([p for _, p in rows]),
                torch.tensor([inputs[i] for i, _ in rows]),
                torch.stack([previous[i] for i, _ in rows]),
            )
            logits = self.layer.compute_logits(out)
            tokens = logits.argmax(dim=-1).tolist()
            for (i, _), token, h in zip(rows, tokens, self.layer.chain_hidden(out)):
                states[i][0].num_computed_tokens += 1
                drafts[i].append(token)
                inputs[i], previous[i] = token, h
            active = [i for i, _ in rows]
        return Drafts(drafts)

    def _run(
        self, shadows: list[Any], positions: torch.Tensor, input_ids: torch.Tensor, previous: torch.Tensor
    ) -> torch.Tensor:
        """One token for each shadow at its next cache slot, with rope at the real ``positions``."""
        from engine.runtime.scheduler import ScheduledBatch

        batch = ScheduledBatch(requests=shadows, num_tokens=[1] * len(shadows))
        _, _, common = self.runner.prepare(batch)
        self.layer.previous_hidden = previous
        self.layer.cache_positions = common.context_lens  # each shadow's own count of entries so far
        return self.layer(input_ids, positions, self.kv_cache.forward_context(common))

    def remove(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            found = self.shadows.pop(request_id, None)
            if found is not None:
                self.kv_manager.free(found[0])
