"""engine-nemotron-h's model through the conformance kit's ModelTests (transformers on the same
random weights)."""

from __future__ import annotations

from typing import Any, ClassVar

from engine.testing.kit import ModelTests


class TestNemotronHKit(ModelTests):
    """Two Mamba-2 layers (eight heads in two groups, a convolution with bias) around an
    attention layer, a relu² MLP and routed relu² experts."""

    plugin = "nemotron_h"
    architecture = "NemotronHForCausalLM"


class TestNemotronHLatentExpertsKit(ModelTests):
    """One group of B and C for all heads, a convolution of 3 without bias, experts inside a
    latent projection, attention first, and tie_word_embeddings set (which transformers'
    NemotronH ignores: the LM head stays its own)."""

    plugin = "nemotron_h"
    architecture = "NemotronHForCausalLM"
    config_overrides: ClassVar[dict[str, Any]] = {
        "layers_block_type": ["full_attention", "linear_attention", "moe", "linear_attention"],
        "n_groups": 1,
        "conv_kernel": 3,
        "use_conv_bias": False,
        "moe_latent_size": 32,
        "tie_word_embeddings": True,
    }
