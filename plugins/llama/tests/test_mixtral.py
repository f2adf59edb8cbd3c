"""Mixtral against transformers on the same random weights: the conformance kit, prompt logits
of a varlen batch (also with a sliding window and three experts a token), greedy tokens in bf16,
cached decode, and its checkpoints' names (block_sparse_moe.experts.E.w1 / w2 / w3) next to
transformers 5's stacked experts."""

from __future__ import annotations

import re

import pytest
import torch
from llama_checkpoints import TinyModelTests, make_checkpoint
from llama_checks import (
    check_bf16_greedy_tokens,
    check_cached_decode_equals_recompute,
    check_prompt_logits,
    stack_experts,
)

ARCHITECTURE = "MixtralForCausalLM"


class TestMixtralKit(TinyModelTests):
    architecture = ARCHITECTURE


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral")
    return path, make_checkpoint(ARCHITECTURE, path)


def test_prompt_logits_match_transformers(checkpoint):
    check_prompt_logits(*checkpoint)


def test_checkpoint_names_experts_as_mixtral_does(checkpoint):
    """The checkpoint is in Mixtral's published layout, which the model loads."""
    from safetensors import safe_open

    path, _ = checkpoint
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {f"model.layers.1.block_sparse_moe.experts.3.{w}.weight" for w in ("w1", "w2", "w3")} <= names
    assert "model.layers.0.block_sparse_moe.gate.weight" in names


def test_sliding_window_and_three_experts_a_token_match_transformers(tmp_path):
    """A window shorter than most prompts."""
    llm = check_prompt_logits(
        tmp_path, make_checkpoint(ARCHITECTURE, tmp_path, sliding_window=6, num_experts_per_tok=3)
    )
    assert [spec.sliding_window for spec in llm.engine.model.kv_cache_specs()] == [6, 6]


def test_bf16_greedy_tokens_match_transformers_for_32_steps(tmp_path):
    check_bf16_greedy_tokens(ARCHITECTURE, tmp_path)


def test_cached_decode_equals_recompute(checkpoint):
    check_cached_decode_equals_recompute(checkpoint[0])


def test_stacked_expert_tensors_load_like_mixtral_ones(checkpoint, tmp_path):
    """transformers 5's names (block_sparse_moe -> mlp; w1, w3, w2 -> gate, up, down) with each
    layer's experts stacked (mlp.experts.gate_up_proj, mlp.experts.down_proj) give the same model."""
    path, hf_model = checkpoint
    projections = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}

    def canonical(name: str) -> str:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        return re.sub(r"\.experts\.(\d+)\.(w[123])\.", lambda m: f".experts.{m[1]}.{projections[m[2]]}.", name)

    stack_experts(path, tmp_path, canonical)
    check_prompt_logits(tmp_path, hf_model)


def test_router_keeps_float32_weights_as_transformers_does(checkpoint):
    """Mixtral's routing weights stay float32 in a bf16 model (Qwen3-MoE's are rounded)."""
    import copy

    from engine.layers.moe import SoftmaxRouter

    _, hf_model = checkpoint
    hf_router = copy.deepcopy(hf_model.model.layers[0].mlp.gate).to(torch.bfloat16)
    router = SoftmaxRouter(4, 64, 2, True, torch.bfloat16, round_weights=False)
    router.weight.data.copy_(hf_router.weight)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.no_grad():
        _, hf_weights, hf_ids = hf_router(x)
    ids, weights = router(x)
    assert torch.equal(ids, hf_ids)
    assert hf_weights.dtype == torch.float32 and torch.equal(weights, hf_weights)
