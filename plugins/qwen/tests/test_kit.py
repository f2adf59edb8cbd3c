"""engine-qwen's models through the conformance kit's ModelTests (transformers on the same
random weights)."""

from __future__ import annotations

from typing import Any, ClassVar

from engine.testing.kit import ModelTests


class TestQwen3_5Kit(ModelTests):
    """Qwen3.5: three gated DeltaNet layers (two key heads for four value heads) around a gated
    attention layer with partial RoPE."""

    plugin = "qwen"
    architecture = "Qwen3_5ForCausalLM"


class TestQwen3_5EqualHeadsKit(ModelTests):
    """As many key heads as value heads, a convolution of 3, and two attention layers."""

    plugin = "qwen"
    architecture = "Qwen3_5ForCausalLM"
    config_overrides: ClassVar[dict[str, Any]] = {
        "linear_num_key_heads": 4,
        "linear_conv_kernel_dim": 3,
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
    }


class TestQwen3_5MoeKit(ModelTests):
    """Qwen3.5-MoE: the same layers, every MLP routed experts (softmax top-2 of 8) and a gated
    shared expert."""

    plugin = "qwen"
    architecture = "Qwen3_5MoeForCausalLM"


class TestQwen3NextKit(ModelTests):
    """Qwen3-Next: its DeltaNet projections fused per key head in the checkpoint, a dense first
    MLP, routed experts after."""

    plugin = "qwen"
    architecture = "Qwen3NextForCausalLM"


class TestQwen3NextUnnormalisedKit(ModelTests):
    """Without norm_topk_prob, experts every second layer, as many key heads as value heads."""

    plugin = "qwen"
    architecture = "Qwen3NextForCausalLM"
    config_overrides: ClassVar[dict[str, Any]] = {
        "norm_topk_prob": False,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [],
        "linear_num_key_heads": 4,
    }


class TestQwen3_5ConditionalGenerationKit(ModelTests):
    """The published checkpoints' multimodal class: the text model under text_config and
    model.language_model, the vision tower skipped."""

    plugin = "qwen"
    architecture = "Qwen3_5ForConditionalGeneration"
    ignored_checkpoint_tensors: ClassVar[tuple[str, ...]] = (r"rotary_emb\.inv_freq$", r"^model\.visual\.")


class TestQwen3_5MoeConditionalGenerationKit(ModelTests):
    plugin = "qwen"
    architecture = "Qwen3_5MoeForConditionalGeneration"
    ignored_checkpoint_tensors: ClassVar[tuple[str, ...]] = (r"rotary_emb\.inv_freq$", r"^model\.visual\.")
