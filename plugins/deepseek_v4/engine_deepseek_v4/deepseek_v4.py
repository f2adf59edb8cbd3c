"""DeepSeek-V4: hyper-connected residual streams, compressed sparse attention and hash-routed
experts, on the engine's paged caches.

The network, as transformers 5.24 (``models/deepseek_v4``) computes it:

- **Hyper-connections.** The residual is ``hc_mult`` streams. Before each attention and
  MLP block a hyper-connection reads the streams (flattened, RMS-normalised, one linear
  map) into three weights: ``pre`` collapses the streams into the block's input, ``post``
  spreads the block's output over them, and ``comb`` (made doubly stochastic by
  Sinkhorn-Knopp iterations) mixes the old streams into the new. ``hc_head`` collapses
  them once more before the final norm. All of this in float32.
- **Attention.** One shared key=value head of ``head_dim`` (512) for every query head;
  queries through the q_lora latent and a per-head RMS normalisation; rope on the
  trailing ``qk_rope_head_dim`` dims, interleaved pairs; attention sinks (a learned
  logit per head that joins the softmax and is dropped); the output's rope dims rotated
  back by the query's position; a grouped low-rank output projection
  (``o_groups`` groups to ``o_lora_rank`` each, then ``o_b_proj``).
  Every layer attends to a sliding window of ``sliding_window`` tokens. Compressed
  layers also attend to compressed entries, one per ``ratio`` tokens: a softmax-gated
  pool of the window's ``kv_proj`` rows (with a learned per-slot bias), RMS-normalised,
  roped at the window's first position. Heavily compressed layers (ratio 128) see every
  finished entry; compressed sparse layers (ratio 4) pool overlapping windows (the
  previous window's first half-series with this one's second) and see the ``index_topk``
  entries a lightning indexer picks, the indexer itself scoring compressed keys pooled
  the same way at ``index_head_dim``. An entry is visible to queries at or after its
  window's last token. Sliding layers rope with θ=``rope_theta``, compressed layers and
  their compressors with θ=``compress_rope_theta`` and YaRN, cos/sin unscaled.
- **Experts.** Every layer routes experts: the first ``num_hash_layers``
  (``mlp_layer_types`` ``hash_moe``) by a fixed token-id table ``tid2eid``, the rest by
  top-k of ``sqrtsoftplus`` scores plus ``e_score_correction_bias``; the chosen scores,
  normalised and times ``routed_scaling_factor``, weight them. Gate and up are clamped
  by ``swiglu_limit`` (gate from above, up both ways) in routed and shared experts.

On the engine. Each attention's parts are KV-cache layers: the window keys and the
compressed entries are two ``sparse_mla`` caches (one entry per token, the value the
whole entry, selected positions given explicitly), and the compressors' per-token
projections are ``token_state`` caches read back when a window completes, possibly steps
later (chunked prefill, decode). The compressed entry of window ``w`` is written at the
slot of the window's last token, ``w·ratio + ratio - 1``; the lightning indexer's
pooled keys likewise, in a ``token_state`` cache, scored in the model. Window and
compressed attention each return their log-sum-exp, merged here with the sinks into one
softmax. Everything is per token in the shared block numbering, so prefix caching and
preemption need nothing special; the price is memory: every token keeps its window key
and its compressor inputs, which a dedicated layout would drop once out of the window.

Router logits are computed in float32 (transformers uses the model dtype; with float32
weights, as in the tests, both agree).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.interfaces.attention import SPARSE_MLA, TOKEN_STATE, AttentionSpec
from engine.interfaces.model import Model, ModelInit
from engine.layers.decoder import require_silu
from engine.layers.linear import Linear, MergedLinear, VocabEmbedding
from engine.layers.rotary import inverse_frequencies
from engine.model_config import HFConfig
from engine.runtime.forward_context import ForwardContext
from engine_deepseek_v4.chat_v4 import encode_chat
from engine.layers.moe import Experts, clamped_swiglu, load_named_tensors

logger = logging.getLogger("engine.deepseek")

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
DEFAULT_RATIOS = {CSA: 4, HCA: 128}


@dataclass(frozen=True)
class V4Dims:
    hidden_size: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    layer_types: tuple[str, ...]
    ratios: dict
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    mlp_layer_types: tuple[str, ...]
    swiglu_limit: float
    scoring_func: str
    routed_scaling_factor: float
    num_experts: int
    experts_per_token: int
    moe_intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_main: dict
    rope_compress: dict
    max_positions: int

    @classmethod
    def from_config(cls, config: HFConfig) -> V4Dims:
        """From transformers' config fields, or the reference checkpoints' (``compress_ratios``,
        ``num_hash_layers``, ``qk_rope_head_dim``, flat ``rope_scaling``)."""
        n, raw = config.num_hidden_layers, config.to_dict()  # nested fields as plain dicts
        ratios = dict(raw.get("compress_rates") or {})
        ratios.setdefault(CSA, config.get("compress_rate_csa", DEFAULT_RATIOS[CSA]))
        ratios.setdefault(HCA, config.get("compress_rate_hca", DEFAULT_RATIOS[HCA]))
        layer_types = config.get("layer_types")
        if layer_types is None and config.get("compress_ratios") is not None:
            by_ratio = {0: SLIDING, ratios[CSA]: CSA, ratios[HCA]: HCA}
            unknown = sorted({r for r in config.compress_ratios if r not in by_ratio})
            if unknown:
                raise ValueError(f"compress_ratios holds {unknown}; known ratios: {sorted(by_ratio)}.")
            layer_types = [by_ratio[r] for r in config.compress_ratios]
        if layer_types is None:  # transformers' default: two HCA layers, then CSA and HCA alternating
            layer_types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        mlp_types = config.get("mlp_layer_types")
        if mlp_types is None:
            hashed = int(config.get("num_hash_layers", 3))
            mlp_types = ["hash_moe"] * min(n, hashed) + ["moe"] * max(0, n - hashed)
        head_dim = int(config.get("head_dim", 512))
        rope_dim = config.get("qk_rope_head_dim") or int(head_dim * (config.get("partial_rotary_factor") or 64 / 512))
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if isinstance(rope.get("main"), dict) and isinstance(rope.get("compress"), dict):
            main, compress = dict(rope["main"]), dict(rope["compress"])
        else:
            main = {"rope_type": "default", "rope_theta": float(config.get("rope_theta", 10000.0))}
            compress = {k: v for k, v in rope.items() if k not in ("main", "compress")}
            compress["rope_type"] = compress.get("rope_type", compress.get("type", "default"))
            compress["rope_theta"] = float(config.get("compress_rope_theta", 160000.0))
        for name, value in (("layer_types", layer_types), ("mlp_layer_types", mlp_types)):
            if len(value) < n:
                raise ValueError(f"{name} lists {len(value)} layers; the model has num_hidden_layers={n}.")
        bad = sorted({t for t in layer_types[:n] if t not in (SLIDING, CSA, HCA)})
        if bad:
            raise ValueError(f"layer_types holds {bad}; DeepSeek-V4 knows {SLIDING}, {CSA}, {HCA}.")
        scoring = config.get("scoring_func", "sqrtsoftplus")
        if scoring not in SCORE_FUNCTIONS:
            raise ValueError(f"scoring_func {scoring!r} is not supported (supported: {', '.join(SCORE_FUNCTIONS)}).")
        return cls(
            hidden_size=config.hidden_size, num_heads=config.num_attention_heads, head_dim=head_dim,
            rope_dim=int(rope_dim), q_lora_rank=config.q_lora_rank, o_groups=config.o_groups,
            o_lora_rank=config.o_lora_rank, sliding_window=int(config.get("sliding_window", 128)),
            layer_types=tuple(layer_types[:n]), ratios=ratios, index_n_heads=config.get("index_n_heads", 64),
            index_head_dim=config.get("index_head_dim", 128), index_topk=config.get("index_topk", 512),
            hc_mult=config.get("hc_mult", 4), hc_sinkhorn_iters=config.get("hc_sinkhorn_iters", 20),
            hc_eps=float(config.get("hc_eps", 1e-6)), mlp_layer_types=tuple(mlp_types[:n]),
            swiglu_limit=float(config.get("swiglu_limit", 10.0)), scoring_func=scoring,
            routed_scaling_factor=float(config.get("routed_scaling_factor", 1.5)),
            num_experts=config.get("n_routed_experts") or config.get("num_local_experts"),
            experts_per_token=config.num_experts_per_tok, moe_intermediate_size=config.moe_intermediate_size,
            vocab_size=config.vocab_size, rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_main=main, rope_compress=compress,
            max_positions=int(config.get("max_position_embeddings", 4096)),
        )


SCORE_FUNCTIONS = {
    "sqrtsoftplus": lambda x: F.softplus(x).sqrt(),
    "sigmoid": torch.sigmoid,
    "softmax": lambda x: x.softmax(dim=-1),
}


# -- small pieces -----------------------------------------------------------------------------


class Fp32RMSNorm(nn.Module):
    """RMSNorm with a float32 weight, multiplied in float32 and cast once (as V4 keeps its norms)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=torch.float32), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (self.weight * (x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps))).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class Rope:
    """Interleaved-pair rope on the trailing ``dim`` dims of a head; cos/sin unscaled."""

    def __init__(self, dim: int, params: dict[str, Any], max_positions: int) -> None:
        self.inv_freq, _ = inverse_frequencies(dim, params, max_positions)  # V4 leaves cos/sin unscaled

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[n] -> cos, sin [n, dim / 2] float32, one angle per pair."""
        if self.inv_freq.device != positions.device:  # moved once, to where the model runs
            self.inv_freq = self.inv_freq.to(positions.device)
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rope on the trailing ``2 · cos.shape[-1]`` dims of x [n, D] or [n, H, D], pairs (x0, x1),
    (x2, x3), ... kept interleaved, in float32; ``inverse`` rotates by the negative angle."""
    dim = 2 * cos.shape[-1]
    if x.dim() == 3:
        cos, sin = cos[:, None, :], sin[:, None, :]
    if inverse:
        sin = -sin
    pairs = x[..., -dim:].float()
    a, b = pairs[..., 0::2], pairs[..., 1::2]
    rotated = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
    return torch.cat([x[..., :-dim], rotated.to(x.dtype)], dim=-1)


class HyperConnection(nn.Module):
    """One manifold-constrained hyper-connection: from the streams [T, n, hidden], the weights
    ``post`` [T, n] and ``comb`` [T, n, n] (float32) and the collapsed block input [T, hidden]."""

    def __init__(self, dims: V4Dims) -> None:
        super().__init__()
        n = self.n = dims.hc_mult
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * dims.hidden_size, dtype=torch.float32), requires_grad=False)
        self.base = nn.Parameter(torch.empty((2 + n) * n, dtype=torch.float32), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32), requires_grad=False)
        self.iters, self.eps, self.norm_eps = dims.hc_sinkhorn_iters, dims.hc_eps, dims.rms_norm_eps

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = self.n
        flat = unweighted_rms_norm(streams.reshape(streams.shape[0], -1).float(), self.norm_eps)
        pre_w, post_w, comb_w = F.linear(flat, self.fn).split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_scale, post_scale, comb_scale = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_scale + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * post_scale + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * comb_scale + comb_b.view(n, n), dim=-1) + self.eps
        # Sinkhorn-Knopp: columns, then rows and columns in turn
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed


def hyper_residual(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams: the block's output spread by ``post`` plus the old streams mixed by ``comb``ᵀ."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(1) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


class HyperHead(nn.Module):
    """The final collapse of the streams [T, n, hidden] -> [T, hidden]."""

    def __init__(self, dims: V4Dims) -> None:
        super().__init__()
        n = dims.hc_mult
        self.hc_fn = nn.Parameter(torch.empty(n, n * dims.hidden_size, dtype=torch.float32), requires_grad=False)
        self.hc_base = nn.Parameter(torch.empty(n, dtype=torch.float32), requires_grad=False)
        self.hc_scale = nn.Parameter(torch.empty(1, dtype=torch.float32), requires_grad=False)
        self.eps, self.norm_eps = dims.hc_eps, dims.rms_norm_eps

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = unweighted_rms_norm(streams.reshape(streams.shape[0], -1).float(), self.norm_eps)
        pre = torch.sigmoid(F.linear(flat, self.hc_fn) * self.hc_scale + self.hc_base) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


# -- attention --------------------------------------------------------------------------------


class Compressor(nn.Module):
    """Pools every ``ratio`` tokens' ``kv_proj`` rows into one entry of ``size`` dims, gated by a
    softmax over ``gate_proj`` + ``position_bias``. With ``overlap`` each token projects two
    series (``2 · size``): entry ``w`` pools window ``w - 1``'s first series with window ``w``'s
    second (none before window 0). The projections of every token are kept in token-state
    layer ``state_layer`` until their windows complete."""

    def __init__(self, dims: V4Dims, ratio: int, size: int, overlap: bool, state_layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        series = 2 if overlap else 1
        self.kv_proj = Linear(dims.hidden_size, series * size, False, dtype)
        self.gate_proj = Linear(dims.hidden_size, series * size, False, dtype)
        self.position_bias = nn.Parameter(torch.empty(ratio, series * size, dtype=torch.float32), requires_grad=False)
        self.kv_norm = Fp32RMSNorm(size, dims.rms_norm_eps)
        self.ratio, self.size, self.overlap, self.state_layer = ratio, size, overlap, state_layer

    def state_size(self) -> int:
        return 2 * self.position_bias.shape[1]  # kv then gate rows

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext, rope: Rope) -> torch.Tensor:
        """[T, size]: the entry of each new token that ends a window (zeros for the others)."""
        ratio, size = self.ratio, self.size
        kv, gate = self.kv_proj(x), self.gate_proj(x)
        ctx.store(self.state_layer, torch.cat([kv, gate], dim=-1))
        entries = x.new_zeros(x.shape[0], size)
        ends = ((positions + 1) % ratio == 0).nonzero().flatten()
        if ends.numel() == 0:
            return entries
        span = (2 if self.overlap else 1) * ratio
        window = positions[:, None] - span + 1 + torch.arange(span, device=x.device)  # [T, span]
        window = window.masked_fill((window < 0) | ((positions + 1) % ratio != 0)[:, None], -1)
        state = ctx.gather(self.state_layer, window)[ends]  # [n, span, 2 · series · size]
        kv_rows, gate_rows = state.split(state.shape[-1] // 2, dim=-1)
        bias = self.position_bias
        if self.overlap:
            first = window[ends, 0] >= 0  # window w - 1 exists
            previous_gate = (gate_rows[:, :ratio, :size].float() + bias[:, :size]).masked_fill(
                ~first[:, None, None], float("-inf"))
            previous_kv = kv_rows[:, :ratio, :size].masked_fill(~first[:, None, None], 0)
            kv_rows = torch.cat([previous_kv, kv_rows[:, ratio:, size:]], dim=1)  # [n, 2 · ratio, size]
            gate_rows = torch.cat([previous_gate, gate_rows[:, ratio:, size:].float() + bias[:, size:]], dim=1)
        else:
            gate_rows = gate_rows.float() + bias
        pooled = (kv_rows * gate_rows.softmax(dim=1).to(kv_rows.dtype)).sum(dim=1)
        cos, sin = rope.cos_sin(positions[ends] + 1 - ratio)  # the window's first position
        entries[ends] = rotate(self.kv_norm(pooled), cos, sin)
        return entries


class LightningIndexer(Compressor):
    """Picks the ``index_topk`` compressed entries each query attends to in a compressed sparse
    layer: ``Σ_h w_h · relu(q_h·k_w) / √index_head_dim`` over keys ``k_w`` pooled as the
    entries are (its own compressor at ``index_head_dim``, overlapping windows), those
    finished by the query's position, kept at their windows' last slots in token-state
    layer ``keys_layer``."""

    def __init__(self, dims: V4Dims, ratio: int, state_layer: int, keys_layer: int, dtype: torch.dtype) -> None:
        super().__init__(dims, ratio, dims.index_head_dim, True, state_layer, dtype)
        self.q_b_proj = Linear(dims.q_lora_rank, dims.index_n_heads * dims.index_head_dim, False, dtype)
        self.scorer = nn.Module()
        self.scorer.weights_proj = Linear(dims.hidden_size, dims.index_n_heads, False, dtype)
        self.dims, self.keys_layer = dims, keys_layer

    def select(self, x: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
               rope: Rope, rope_q: tuple[torch.Tensor, torch.Tensor], finished: torch.Tensor) -> torch.Tensor:
        """[T, k]: positions (window ends) of each query's chosen entries, -1 padded. ``finished``:
        [T, n_max] the window ends the step's queries may see (-1 where not yet)."""
        d = self.dims
        ctx.store(self.keys_layer, self(x, positions, ctx, rope))
        keys = ctx.gather(self.keys_layer, finished).float()  # [T, n_max, index_head_dim]
        q = self.q_b_proj(q_latent).view(x.shape[0], d.index_n_heads, d.index_head_dim)
        q = rotate(q, *rope_q)
        scores = torch.einsum("thd,tnd->thn", q.float(), keys).relu_() * d.index_head_dim**-0.5
        weights = self.scorer.weights_proj(x).float() * d.index_n_heads**-0.5  # [T, heads]
        total = torch.einsum("thn,th->tn", scores, weights).masked_fill_(finished < 0, float("-inf"))
        best, chosen = total.topk(min(d.index_topk, total.shape[1]), dim=-1)
        return finished.gather(1, chosen).masked_fill_(best == float("-inf"), -1)


class GroupedProjection(nn.Module):
    """``o_a_proj``: weight [groups · rank, in / groups]; group g's slice of the input goes through
    its own [rank, in / groups] block."""

    def __init__(self, in_per_group: int, rank: int, groups: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(groups * rank, in_per_group, dtype=dtype), requires_grad=False)
        self.groups = groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, groups, in / groups] -> [T, groups · rank]."""
        w = self.weight.view(self.groups, -1, self.weight.shape[1])
        return torch.einsum("tgi,goi->tgo", x, w).flatten(1)


class Step:
    """What every layer of one forward pass shares: positions, token ids, each rope's cos/sin.

    ``cache_positions`` are where the tokens sit in their sequences' caches, which the sliding
    window counts back from; they are the rope ``positions`` except in the MTP block, whose
    cache holds only the positions it ran (compressed layers, which it has none of, use
    ``positions`` throughout)."""

    def __init__(self, input_ids: torch.Tensor, positions: torch.Tensor, ropes: dict[str, Rope],
                 cache_positions: torch.Tensor | None = None) -> None:
        self.input_ids, self.positions = input_ids, positions
        self.cache_positions = positions if cache_positions is None else cache_positions
        self.ropes = {name: (rope, rope.cos_sin(positions)) for name, rope in ropes.items()}
        self._finished: dict[int, torch.Tensor] = {}

    def finished(self, ratio: int) -> torch.Tensor:
        """[T, n] the last positions of the windows of ``ratio`` that some query of the step has
        reached, -1 where this query has not (at least one column, all -1 if none)."""
        if ratio not in self._finished:
            max_position = int(self.positions.max()) if self.positions.numel() else 0  # only once a layer asks
            ends = torch.arange(max(1, (max_position + 1) // ratio), device=self.positions.device) * ratio
            ends = ends + ratio - 1
            self._finished[ratio] = ends[None, :].expand(self.positions.shape[0], -1).masked_fill(
                ends[None, :] > self.positions[:, None], -1)
        return self._finished[ratio]


@dataclass(frozen=True)
class CacheLayers:
    """The KV-cache layer indices of one attention (None where its type has no such part)."""

    window: int
    compressed: int | None = None
    state: int | None = None
    index_state: int | None = None
    index_keys: int | None = None


class V4Attention(nn.Module):
    def __init__(self, dims: V4Dims, layer_type: str, layers: CacheLayers, dtype: torch.dtype) -> None:
        super().__init__()
        d = self.dims = dims
        self.q_a_proj = Linear(d.hidden_size, d.q_lora_rank, False, dtype)
        self.q_a_norm = Fp32RMSNorm(d.q_lora_rank, d.rms_norm_eps)
        self.q_b_proj = Linear(d.q_lora_rank, d.num_heads * d.head_dim, False, dtype)
        self.kv_proj = Linear(d.hidden_size, d.head_dim, False, dtype)
        self.kv_norm = Fp32RMSNorm(d.head_dim, d.rms_norm_eps)
        self.o_a_proj = GroupedProjection(d.num_heads * d.head_dim // d.o_groups, d.o_lora_rank, d.o_groups, dtype)
        self.o_b_proj = Linear(d.o_groups * d.o_lora_rank, d.hidden_size, False, dtype)
        self.sinks = nn.Parameter(torch.empty(d.num_heads, dtype=torch.float32), requires_grad=False)
        self.layer_type, self.layers = layer_type, layers
        self.compressor = None
        if layer_type != SLIDING:
            ratio = d.ratios[layer_type]
            self.compressor = Compressor(d, ratio, d.head_dim, layer_type == CSA, layers.state, dtype)
            if layer_type == CSA:
                self.compressor.indexer = LightningIndexer(d, ratio, layers.index_state, layers.index_keys, dtype)

    def forward(self, x: torch.Tensor, step: Step, ctx: ForwardContext) -> torch.Tensor:
        d, num_tokens, positions = self.dims, x.shape[0], step.positions
        rope, (cos, sin) = step.ropes["main" if self.layer_type == SLIDING else "compress"]
        q_latent = self.q_a_norm(self.q_a_proj(x))
        q = unweighted_rms_norm(self.q_b_proj(q_latent).view(num_tokens, d.num_heads, d.head_dim), d.rms_norm_eps)
        q = rotate(q, cos, sin)
        kv = rotate(self.kv_norm(self.kv_proj(x)), cos, sin)  # [T, head_dim], key and value
        window = step.cache_positions[:, None] - d.sliding_window + 1 + torch.arange(d.sliding_window,
                                                                                      device=x.device)
        lse = [torch.empty(num_tokens, d.num_heads, device=x.device)]
        parts = [ctx.sparse_attention(self.layers.window, q, kv.unsqueeze(1), window.masked_fill(window < 0, -1),
                                      lse[0])]
        if self.compressor is not None:
            compress_rope, compress_cos_sin = step.ropes["compress"]
            entries = self.compressor(x, positions, ctx, compress_rope)
            finished = step.finished(self.compressor.ratio)
            if self.layer_type == CSA:
                finished = self.compressor.indexer.select(x, q_latent, positions, ctx, compress_rope, compress_cos_sin,
                                                          finished)
            lse.append(torch.empty(num_tokens, d.num_heads, device=x.device))
            parts.append(ctx.sparse_attention(self.layers.compressed, q, entries.unsqueeze(1), finished, lse[1]))
        out = merge_with_sinks(parts, lse, self.sinks).to(x.dtype)  # [T, H, head_dim]
        out = rotate(out, cos, sin, inverse=True)  # the values' rope, undone at the query's position
        grouped = self.o_a_proj(out.reshape(num_tokens, d.o_groups, -1))
        return self.o_b_proj(grouped)


def merge_with_sinks(parts: list[torch.Tensor], lse: list[torch.Tensor], sinks: torch.Tensor) -> torch.Tensor:
    """One softmax over every part's keys and a sink logit per head (which takes weight but gives
    no value): Σ_i e^{lse_i} · out_i / (Σ_i e^{lse_i} + e^{sink}), in float32."""
    sink = sinks.float()[None, :].expand_as(lse[0])
    top = torch.stack([*lse, sink]).amax(dim=0)
    weights = [torch.exp(part_lse - top) for part_lse in lse]
    total = sum(weights) + torch.exp(sink - top)
    return sum(w.unsqueeze(-1) * part.float() for w, part in zip(weights, parts)) / total.unsqueeze(-1)


# -- experts ----------------------------------------------------------------------------------


class V4Router(nn.Module):
    """Scores ``scoring_func(x · Wᵀ)``; experts by top-k of score + ``e_score_correction_bias``,
    or (hash layers) by ``tid2eid[token]``; weights the chosen scores normalised, times
    ``routed_scaling_factor``."""

    def __init__(self, dims: V4Dims, hashed: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dims.num_experts, dims.hidden_size), requires_grad=False)
        if hashed:
            self.tid2eid = nn.Parameter(torch.zeros(dims.vocab_size, dims.experts_per_token, dtype=torch.int64),
                                        requires_grad=False)
        else:
            self.e_score_correction_bias = nn.Parameter(torch.empty(dims.num_experts), requires_grad=False)
        self.dims, self.hashed = dims, hashed

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.dims
        scores = SCORE_FUNCTIONS[d.scoring_func](F.linear(x.float(), self.weight.float()))  # [T, E]
        if self.hashed:
            chosen = self.tid2eid[input_ids]
        else:
            chosen = (scores + self.e_score_correction_bias.float()).topk(d.experts_per_token, dim=-1, sorted=False)[1]
        weights = scores.gather(1, chosen)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return chosen, weights * d.routed_scaling_factor


class ClampedMLP(nn.Module):
    """The shared expert: ``down(silu(min(gate, limit)) · clamp(up, ±limit))``."""

    def __init__(self, hidden_size: int, intermediate_size: int, limit: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size] * 2, False, dtype)
        self.down_proj = Linear(intermediate_size, hidden_size, False, dtype)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clamped_swiglu(self.gate_up_proj(x), self.limit))


class V4MoE(nn.Module):
    def __init__(self, dims: V4Dims, hashed: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate = V4Router(dims, hashed)
        self.experts = Experts(dims.num_experts, dims.moe_intermediate_size, dims.hidden_size, dtype,
                               swiglu_limit=dims.swiglu_limit)
        self.shared_experts = ClampedMLP(dims.hidden_size, dims.moe_intermediate_size, dims.swiglu_limit, dtype)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        expert_ids, weights = self.gate(x, input_ids)
        return self.experts(x, expert_ids, weights, ctx) + self.shared_experts(x)


class V4DecoderLayer(nn.Module):
    def __init__(self, dims: V4Dims, index: int, layers: CacheLayers, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = V4Attention(dims, dims.layer_types[index], layers, dtype)
        self.mlp = V4MoE(dims, dims.mlp_layer_types[index] == "hash_moe", dtype)
        self.input_layernorm = Fp32RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.post_attention_layernorm = Fp32RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.attn_hc = HyperConnection(dims)
        self.ffn_hc = HyperConnection(dims)

    def forward(self, streams: torch.Tensor, step: Step, ctx: ForwardContext) -> torch.Tensor:
        post, comb, collapsed = self.attn_hc(streams)
        streams = hyper_residual(streams, self.self_attn(self.input_layernorm(collapsed), step, ctx), post, comb)
        post, comb, collapsed = self.ffn_hc(streams)
        return hyper_residual(streams, self.mlp(self.post_attention_layernorm(collapsed), step.input_ids, ctx),
                              post, comb)


class V4Stack(nn.Module):
    """``model.*`` of the checkpoint: embedding, layers, ``hc_head`` and the final norm."""

    def __init__(self, dims: V4Dims, layers: list[V4DecoderLayer], dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(dims.vocab_size, dims.hidden_size, dtype)
        self.layers = nn.ModuleList(layers)
        self.hc_head = HyperHead(dims)
        self.norm = Fp32RMSNorm(dims.hidden_size, dims.rms_norm_eps)


class DeepseekV4ForCausalLM(Model):
    chat_encoder = staticmethod(encode_chat)  # V4 ships its prompt format as code (chat_v4.py)
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
                    parts.update(compressed=cache_layer(entry), state=cache_layer(token_state(4 * d.head_dim)),
                                 index_state=cache_layer(token_state(4 * d.index_head_dim)),
                                 index_keys=cache_layer(token_state(d.index_head_dim)))
                layers.append(V4DecoderLayer(d, i, CacheLayers(**parts), dtype))
            self.model = V4Stack(d, layers, dtype)
            self.lm_head = Linear(d.hidden_size, d.vocab_size, False, dtype)
        self.ropes = {"main": Rope(d.rope_dim, d.rope_main, d.max_positions),
                      "compress": Rope(d.rope_dim, d.rope_compress, d.max_positions)}

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


# The reference checkpoints' tensor names -> transformers' (as transformers converts them on load;
# its save_pretrained writes them back this way, under "model." for the decoder's).
_RENAMES = [
    (r"^embed\.weight$", "embed_tokens.weight"),
    (r"^head\.weight$", "lm_head.weight"),
    (r"^hc_head_(fn|base|scale)$", r"hc_head.hc_\1"),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_(fn|base|scale)$", r".attn_hc.\1"),
    (r"\.hc_ffn_(fn|base|scale)$", r".ffn_hc.\1"),
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"\.self_attn\.indexer\.weights_proj\.", ".self_attn.compressor.indexer.scorer.weights_proj."),
    (r"\.self_attn\.indexer\.wq_b\.", ".self_attn.compressor.indexer.q_b_proj."),
    (r"\.attn_sink$", ".sinks"),
    (r"\.norm\.", ".kv_norm."),  # the attention's and the compressors' norms
    (r"\.ape$", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.(shared_experts|experts\.\d+)\.w1\.", r".\1.gate_proj."),
    (r"\.(shared_experts|experts\.\d+)\.w2\.", r".\1.down_proj."),
    (r"\.(shared_experts|experts\.\d+)\.w3\.", r".\1.up_proj."),
]


def transformers_name(name: str) -> str:
    """A checkpoint tensor's name as transformers' modules name it. Reference checkpoints name
    them ``layers.N.attn.wq_a.weight``, ``embed.weight``, ``head.weight`` ...; transformers
    saves the same names, the decoder's under ``model.``; its own names pass unchanged."""
    if name.startswith(("mtp.", "lm_head.")):
        return name
    body = name.removeprefix("model.")
    for pattern, replacement in _RENAMES:
        body = re.sub(pattern, replacement, body)
    return body if body.startswith("lm_head.") else "model." + body


class MtpV4Layer(Model):
    """DeepSeek-V4's multi-token-prediction block (``mtp.0.*`` of the reference checkpoints),
    read as the ``mtp`` proposer runs it.

    From the target's hyper-connection streams ``h`` [n, hidden] before its ``hc_head`` and
    the embedding ``e`` of the next token, the streams ``e_proj(enorm(e)) + h_proj(hnorm(h_k))``
    (every stream k) go through one decoder block (sliding-window attention, experts routed
    by score), its own ``hc_head`` and ``norm``, and the target's LM head. Drafting further
    chains the block's output streams. The embedding and the head are the target's.
    """

    provides_pre_head_hidden_states = True

    def __init__(self, config: HFConfig, dtype: torch.dtype) -> None:
        super().__init__()
        from dataclasses import replace

        d = V4Dims.from_config(config)
        self.dims = d = replace(d, layer_types=(SLIDING,), mlp_layer_types=("moe",))
        self.spec = AttentionSpec(SPARSE_MLA, d.num_heads, 1, d.head_dim, d.head_dim**-0.5, latent_size=d.head_dim)
        self.embed_tokens = VocabEmbedding(d.vocab_size, d.hidden_size, dtype)
        self.enorm = Fp32RMSNorm(d.hidden_size, d.rms_norm_eps)
        self.hnorm = Fp32RMSNorm(d.hidden_size, d.rms_norm_eps)
        self.e_proj = Linear(d.hidden_size, d.hidden_size, False, dtype)
        self.h_proj = Linear(d.hidden_size, d.hidden_size, False, dtype)
        self.block = V4DecoderLayer(d, 0, CacheLayers(window=0), dtype)
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
