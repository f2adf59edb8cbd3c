"""engine-kimi-k3 through the model conformance kit."""

from __future__ import annotations

from typing import Any, ClassVar

from engine.testing.kit import ModelTests


class TestKimiLinearKit(ModelTests):
    """Kimi Linear: KDA layers around an MLA layer, no q_lora, a dense first layer."""

    plugin = "kimi_k3"
    architecture = "KimiLinearForCausalLM"


class TestKimiLinearQLoraKit(ModelTests):
    """With q_lora in the MLA layer, grouped routing, two shared experts and a convolution of 3."""

    plugin = "kimi_k3"
    architecture = "KimiLinearForCausalLM"
    config_overrides: ClassVar[dict[str, Any]] = {
        "q_lora_rank": 24,
        "num_expert_group": 2,
        "topk_group": 1,
        "num_shared_experts": 2,
        "linear_conv_kernel_dim": 3,
    }
