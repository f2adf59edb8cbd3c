"""A tiny random gpt-oss model, made and saved by transformers (the reference)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

SLIDING, FULL = "sliding_attention", "full_attention"

# A window of 8 tokens (the tests' prompts are longer); YaRN stretching 64 positions four times,
# on a base of its own; swiglu_limit low enough that the clamps bite on random weights.
TINY_GPT_OSS = dict(
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=320,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    sliding_window=8,
    layer_types=[SLIDING, FULL, SLIDING],
    num_local_experts=8,
    num_experts_per_tok=2,
    swiglu_limit=0.4,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 5000.0,
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 64,
    },
)


def make_gpt_oss_checkpoint(path: str | Path, *, dtype: str = "float32", seed: int = 0, **overrides: Any) -> Any:
    """Save a random ``GptOssForCausalLM`` (``TINY_GPT_OSS`` with ``overrides``) to ``path``; return
    it (eval mode). Biases and norm weights are random too (transformers starts them constant),
    and the sinks large enough to take a good share of each head's attention."""
    import torch
    import transformers

    from engine.testing.checkpoints import randomize_constant_parameters

    config = transformers.GptOssConfig(**{**TINY_GPT_OSS, **overrides})
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)
            layer.mlp.experts.gate_up_proj_bias.normal_(0.0, 0.1)
            layer.mlp.experts.down_proj_bias.normal_(0.0, 0.1)
    randomize_constant_parameters(model, seed + 1)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(Path(path))
    return model
