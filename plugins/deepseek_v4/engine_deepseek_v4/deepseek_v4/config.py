"""DeepSeek-V4's configuration: the three attention layer types, ``V4Dims`` (every size
and setting the network reads, from transformers' config fields or the reference
checkpoints') and the router's scoring functions, which ``scoring_func`` names."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.model_config import HFConfig

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
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            head_dim=head_dim,
            rope_dim=int(rope_dim),
            q_lora_rank=config.q_lora_rank,
            o_groups=config.o_groups,
            o_lora_rank=config.o_lora_rank,
            sliding_window=int(config.get("sliding_window", 128)),
            layer_types=tuple(layer_types[:n]),
            ratios=ratios,
            index_n_heads=config.get("index_n_heads", 64),
            index_head_dim=config.get("index_head_dim", 128),
            index_topk=config.get("index_topk", 512),
            hc_mult=config.get("hc_mult", 4),
            hc_sinkhorn_iters=config.get("hc_sinkhorn_iters", 20),
            hc_eps=float(config.get("hc_eps", 1e-6)),
            mlp_layer_types=tuple(mlp_types[:n]),
            swiglu_limit=float(config.get("swiglu_limit", 10.0)),
            scoring_func=scoring,
            routed_scaling_factor=float(config.get("routed_scaling_factor", 1.5)),
            num_experts=config.get("n_routed_experts") or config.get("num_local_experts"),
            experts_per_token=config.num_experts_per_tok,
            moe_intermediate_size=config.moe_intermediate_size,
            vocab_size=config.vocab_size,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_main=main,
            rope_compress=compress,
            max_positions=int(config.get("max_position_embeddings", 4096)),
        )


# The router's scores by ``scoring_func``; kept here so that V4Dims refuses an unknown name
# when the config is read, not when the first token is routed.
SCORE_FUNCTIONS = {
    "sqrtsoftplus": lambda x: F.softplus(x).sqrt(),
    "sigmoid": torch.sigmoid,
    "softmax": lambda x: x.softmax(dim=-1),
}
