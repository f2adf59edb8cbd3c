"""engine-gpt-oss's model through the conformance kit's ModelTests (transformers on the same random
weights)."""

from __future__ import annotations

import pytest
from tiny_gpt_oss import make_gpt_oss_checkpoint

from engine.testing.kit import ModelTests


class TestGptOssKit(ModelTests):
    """Three layers, sliding (a window of 8 tokens, shorter than most of the kit's prompts) around
    a full one, each with its heads' sinks; eight experts, two per token."""

    plugin = "gpt_oss"
    architecture = "GptOssForCausalLM"

    @pytest.fixture(scope="class")
    @classmethod
    def checkpoint(cls, tmp_path_factory):
        path = tmp_path_factory.mktemp("gpt_oss")
        return path, make_gpt_oss_checkpoint(path)
