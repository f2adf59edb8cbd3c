"""engine-gemma's model through the conformance kit's ModelTests (transformers on the same random
weights)."""

from __future__ import annotations

from typing import ClassVar

import pytest
from tiny_gemma3 import make_gemma3_checkpoint, make_gemma3_multimodal_checkpoint

from engine.testing.kit import ModelTests


class TestGemma3Kit(ModelTests):
    """Four layers, local (a window of 8 tokens, shorter than most of the kit's prompts) on both
    sides of a global one, tied embeddings."""

    plugin = "gemma"
    architecture = "Gemma3ForCausalLM"

    @pytest.fixture(scope="class")
    @classmethod
    def checkpoint(cls, tmp_path_factory):
        path = tmp_path_factory.mktemp("gemma3")
        return path, make_gemma3_checkpoint(path)


class TestGemma3CappedBiasedKit(ModelTests):
    """Attention biases, the final logits capped, an LM head of its own, and a config.json in the
    older form: ``sliding_window_pattern``, ``rope_theta``, ``rope_local_base_freq`` and a linear
    ``rope_scaling`` instead of ``layer_types`` and per-type ``rope_parameters``."""

    plugin = "gemma"
    architecture = "Gemma3ForCausalLM"

    @pytest.fixture(scope="class")
    @classmethod
    def checkpoint(cls, tmp_path_factory):
        import json

        path = tmp_path_factory.mktemp("gemma3_capped")
        hf_model = make_gemma3_checkpoint(
            path,
            attention_bias=True,
            final_logit_softcapping=3.0,
            tie_word_embeddings=False,
            num_hidden_layers=3,
            layer_types=None,
            sliding_window_pattern=3,
        )
        config = json.loads((path / "config.json").read_text())
        for field in ("layer_types", "rope_parameters"):
            del config[field]
        config.update(
            rope_theta=5000.0, rope_local_base_freq=700.0, rope_scaling={"rope_type": "linear", "factor": 2.0}
        )
        (path / "config.json").write_text(json.dumps(config))
        return path, hf_model


class TestGemma3ConditionalGenerationKit(ModelTests):
    """The published checkpoints' multimodal class on text prompts: the text model under
    text_config and ``language_model.*`` with an LM head of its own, the vision tower and
    projector skipped."""

    plugin = "gemma"
    architecture = "Gemma3ForConditionalGeneration"
    ignored_checkpoint_tensors: ClassVar[tuple[str, ...]] = (r"^vision_tower\.", r"^multi_modal_projector\.")

    @pytest.fixture(scope="class")
    @classmethod
    def checkpoint(cls, tmp_path_factory):
        path = tmp_path_factory.mktemp("gemma3_multimodal")
        return path, make_gemma3_multimodal_checkpoint(path, tie_word_embeddings=False)
