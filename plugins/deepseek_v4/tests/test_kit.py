"""engine-deepseek-v4 through the model conformance kit."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from engine.testing.kit import ModelTests


class TestDeepseekV3Kit(ModelTests):
    plugin = "deepseek_v4"
    architecture = "DeepseekV3ForCausalLM"


class TestDeepseekV3YarnKit(ModelTests):
    """YaRN rope with mscale in the softmax scale, no q_lora, rope not interleaved."""

    plugin = "deepseek_v4"
    architecture = "DeepseekV3ForCausalLM"
    config_overrides: ClassVar[dict[str, Any]] = {
        "q_lora_rank": None,
        "rope_interleave": False,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
            "beta_fast": 32,
            "beta_slow": 1,
            "original_max_position_embeddings": 64,
        },
    }


class TestKimiK2StyleKit(ModelTests):
    """Kimi-K2's routing: one expert group, three experts a token, its scaling factor, no
    dense layer first, two shared experts."""

    plugin = "deepseek_v4"
    architecture = "DeepseekV3ForCausalLM"
    config_overrides: ClassVar[dict[str, Any]] = {
        "n_group": 1,
        "topk_group": 1,
        "num_experts_per_tok": 3,
        "routed_scaling_factor": 2.827,
        "first_k_dense_replace": 0,
        "n_shared_experts": 2,
        "norm_topk_prob": True,
    }


class TestDeepseekV32Kit(ModelTests):
    """DeepSeek-V3.2: sparse MLA with an indexer whose index_topk covers every kit sequence, so
    that the selection is every causal position, as transformers' is."""

    plugin = "deepseek_v4"
    architecture = "DeepseekV32ForCausalLM"


class TestDeepseekV32SparseKit(ModelTests):
    """DeepSeek-V3.2 with index_topk 5, so that each query attends to a few selected positions:
    cached decode against recompute and chunked prefill against whole prefill. Transformers'
    logits are left out here (which positions tie among ReLU'd indexer scores can depend on how
    a batch is padded); test_deepseek_v32.py compares with a dense-masked reference instead."""

    plugin = "deepseek_v4"
    architecture = "DeepseekV32ForCausalLM"

    @pytest.fixture(scope="class")
    @classmethod
    def checkpoint(cls, tmp_path_factory):
        from engine.testing.checkpoints import make_tiny_checkpoint

        path = tmp_path_factory.mktemp("deepseek_v32_sparse")
        make_tiny_checkpoint(cls.architecture, path, index_topk=5, index_n_heads=8, seed=5)
        return path, None


class TestDeepseekV4Kit(ModelTests):
    """DeepSeek-V4: hyper-connections; sliding, compressed sparse (ratio 4) and heavily compressed
    (ratio 16) attention with a window of 8, so the kit's sequences cross windows and finish
    compressed entries; hash-routed and scored experts."""

    plugin = "deepseek_v4"
    architecture = "DeepseekV4ForCausalLM"
