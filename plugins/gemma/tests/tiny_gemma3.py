"""A tiny random Gemma 3 text model, made and saved by transformers (the reference)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

SLIDING, FULL = "sliding_attention", "full_attention"

# Every field that changes the numbers is off its default: a window of 8 tokens (the tests' prompts
# are longer), local layers on both sides of a global one, query_pre_attn_scalar unlike head_dim,
# local and global rope bases of their own and linear scaling on the global layers only.
TINY_GEMMA3 = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=320,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    sliding_window=8,
    layer_types=[SLIDING, FULL, SLIDING, SLIDING],
    query_pre_attn_scalar=24,
    rope_parameters={
        FULL: {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0},
        SLIDING: {"rope_type": "default", "rope_theta": 700.0},
    },
)


def make_gemma3_checkpoint(path: str | Path, *, dtype: str = "float32", seed: int = 0, **overrides: Any) -> Any:
    """Save a random ``Gemma3ForCausalLM`` (``TINY_GEMMA3`` with ``overrides``) to ``path``; return it
    (eval mode). Norm weights are random too (transformers starts them at 0, which an unloaded
    norm would also hold)."""
    import torch
    import transformers

    from engine.testing.checkpoints import randomize_constant_parameters

    config = transformers.Gemma3TextConfig(**{**TINY_GEMMA3, **overrides})
    torch.manual_seed(seed)
    model = transformers.Gemma3ForCausalLM(config).to(getattr(torch, dtype)).eval()
    randomize_constant_parameters(model, seed + 1)
    model.save_pretrained(Path(path))
    return model


# a one-layer SigLIP tower on 16×16 images in 4×4 patches, pooled to 2×2 image tokens
TINY_SIGLIP = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=16, patch_size=4
)


def make_gemma3_multimodal_checkpoint(
    path: str | Path,
    *,
    seed: int = 0,
    tie_word_embeddings: bool = True,
    save_original_format: bool = True,
    **text_overrides: Any,
) -> Any:
    """Save a random ``Gemma3ForConditionalGeneration`` (``TINY_GEMMA3`` with ``text_overrides`` and
    ``TINY_SIGLIP``) to ``path``; return it (eval mode, float32). ``save_original_format`` names the
    tensors as the hub's checkpoints do (``language_model.model.*``), else as transformers 5's modules
    (``model.language_model.*``)."""
    import torch
    import transformers

    from engine.testing.checkpoints import randomize_constant_parameters

    config = transformers.Gemma3Config(
        text_config={**TINY_GEMMA3, **text_overrides},
        vision_config=TINY_SIGLIP,
        mm_tokens_per_image=4,
        tie_word_embeddings=tie_word_embeddings,
    )
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    randomize_constant_parameters(model, seed + 1)
    model.save_pretrained(Path(path), save_original_format=save_original_format)
    return model
