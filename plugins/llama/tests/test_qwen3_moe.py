"""Qwen3-MoE against transformers on the same random weights: the conformance kit, prompt
logits of a varlen batch (experts in every layer; dense layers where decoder_sparse_step and
mlp_only_layers say, unnormalised top-k weights and a sliding window), greedy tokens in bf16,
cached decode, and the stacked expert layout."""

from __future__ import annotations

import copy

import pytest
import torch
from llama_checkpoints import TinyModelTests, make_checkpoint
from llama_checks import (
    check_bf16_greedy_tokens,
    check_cached_decode_equals_recompute,
    check_prompt_logits,
    stack_experts,
)

ARCHITECTURE = "Qwen3MoeForCausalLM"


class TestQwen3MoeKit(TinyModelTests):
    architecture = ARCHITECTURE


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe")
    return path, make_checkpoint(ARCHITECTURE, path)


def test_prompt_logits_match_transformers(checkpoint):
    check_prompt_logits(*checkpoint)


def test_layers_follow_decoder_sparse_step_and_mlp_only_layers(tmp_path):
    """Experts where (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers, their
    top-k weights as the softmax gives them (norm_topk_prob false); a sliding window on every
    layer (use_sliding_window) shorter than the prompts."""
    overrides = dict(
        num_hidden_layers=4,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
        norm_topk_prob=False,
        use_sliding_window=True,
        sliding_window=6,
    )
    hf_model = make_checkpoint(ARCHITECTURE, tmp_path, **overrides)
    sparse = [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in hf_model.model.layers]
    assert sparse == [False, True, False, False]
    llm = check_prompt_logits(tmp_path, hf_model)
    model = llm.engine.model
    assert [hasattr(layer.mlp, "experts") for layer in model.model.layers] == sparse
    assert [spec.sliding_window for spec in model.kv_cache_specs()] == [6] * 4


def test_bf16_greedy_tokens_match_transformers_for_32_steps(tmp_path):
    check_bf16_greedy_tokens(ARCHITECTURE, tmp_path)


def test_cached_decode_equals_recompute(checkpoint):
    check_cached_decode_equals_recompute(checkpoint[0])


def test_stacked_expert_tensors_load_like_per_expert_ones(checkpoint, tmp_path):
    """transformers 5's in-memory layout (mlp.experts.gate_up_proj [E, 2I, hidden] holding each
    expert's gate rows then up rows, mlp.experts.down_proj [E, hidden, I]) gives the same model."""
    path, hf_model = checkpoint
    stack_experts(path, tmp_path, lambda name: name)
    check_prompt_logits(tmp_path, hf_model)


def test_router_weights_are_rounded_to_the_model_dtype_as_transformers_does(checkpoint):
    from engine.layers.moe import SoftmaxRouter

    _, hf_model = checkpoint
    hf_router = copy.deepcopy(hf_model.model.layers[0].mlp.gate).to(torch.bfloat16)
    router = SoftmaxRouter(4, 64, 2, True, torch.bfloat16, round_weights=True)
    router.weight.data.copy_(hf_router.weight)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.no_grad():
        _, hf_weights, hf_ids = hf_router(x)
    ids, weights = router(x)
    assert torch.equal(ids, hf_ids)
    assert hf_weights.dtype == torch.bfloat16 and torch.equal(weights, hf_weights.float())
