"""Tiny random checkpoints of the architectures engine.testing.checkpoints has no config for
(Qwen3-MoE, Mixtral, Phi-3), made with transformers as the kit's are, and a ``ModelTests``
base whose ``checkpoint`` fixture makes them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.testing.kit import ModelTests

_ATTENTION = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=320,
    max_position_embeddings=512,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    # four experts of 32, two a token, renormalised; Qwen3's head_dim apart from hidden / heads
    "Qwen3MoeForCausalLM": dict(
        _ATTENTION,
        head_dim=32,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
    ),
    "MixtralForCausalLM": dict(_ATTENTION, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2),
    "Phi3ForCausalLM": dict(_ATTENTION, intermediate_size=128),
}


def make_checkpoint(architecture: str, path: Path, *, dtype: str = "float32", seed: int = 0, **overrides: Any) -> Any:
    """Save a random ``architecture`` model (norm weights random too) to ``path``; return the
    transformers model on those weights."""
    import torch
    import transformers

    from engine.testing.checkpoints import randomize_constant_parameters

    model_class = getattr(transformers, architecture)
    config = model_class.config_class(**{**TINY_CONFIGS[architecture], **overrides})
    torch.manual_seed(seed)
    model = model_class(config).to(getattr(torch, dtype)).eval()
    randomize_constant_parameters(model, seed + 1)
    model.save_pretrained(path)
    return model


class TinyModelTests(ModelTests):
    """``ModelTests`` on a checkpoint of :data:`TINY_CONFIGS`, with the kit's moved rope base."""

    plugin = "llama"

    @pytest.fixture(scope="class")
    @classmethod
    def checkpoint(cls, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
        import transformers

        from engine.testing.kit.model import moved_defaults

        architecture = cls.architecture
        if architecture not in TINY_CONFIGS:
            raise NotImplementedError(f"{cls.__name__}: no tiny config for architecture {architecture!r}.")
        config_class = getattr(transformers, architecture).config_class
        config = config_class(**{**TINY_CONFIGS[architecture], **cls.config_overrides})
        overrides = {**cls.config_overrides, **moved_defaults(config, cls.config_overrides)}
        path = tmp_path_factory.mktemp(architecture)
        return path, make_checkpoint(architecture, path, dtype=cls.dtype, **overrides)
