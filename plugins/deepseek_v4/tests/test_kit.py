"""engine-deepseek-v4 through the model conformance kit."""

from __future__ import annotations

from typing import Any, ClassVar

from engine.testing.kit import ModelTests


class TestDeepseekV3Kit(ModelTests):
    plugin = "deepseek_v4"
    architecture = "DeepseekV3ForCausalLM"


class TestDeepseekV3YarnKit(ModelTests):
    """YaRN rope with mscale in the softmax scale, no q_lora, rope not interleaved."""

    plugin = "deepseek_v4"
    architecture = "DeepseekV3ForCausalLM"
    config_overrides: ClassVar[dict[str, Any]] = {
        "q_lora_rank": None, "rope_interleave": False,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "mscale": 1.0,
                            "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1,
                            "original_max_position_embeddings": 64},
    }
