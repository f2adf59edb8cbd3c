"""engine-llama through the model conformance kit: one class per registered architecture."""

from __future__ import annotations

from typing import Any, ClassVar

from engine.testing.kit import ModelTests


class TestLlamaKit(ModelTests):
    plugin = "llama"
    architecture = "LlamaForCausalLM"


class TestMistralKit(ModelTests):
    plugin = "llama"
    architecture = "MistralForCausalLM"
    config_overrides: ClassVar[dict[str, Any]] = {
        "sliding_window": 8
    }  # shorter than the prompts: the window is exercised


class TestQwen2Kit(ModelTests):
    plugin = "llama"
    architecture = "Qwen2ForCausalLM"


class TestQwen3Kit(ModelTests):
    plugin = "llama"
    architecture = "Qwen3ForCausalLM"
