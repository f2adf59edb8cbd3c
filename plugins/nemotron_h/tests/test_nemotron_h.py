"""Nemotron-H against transformers on the same random weights, beyond the kit: greedy
generation of a batch (fp32, and bf16 for 32 steps), prefill in chunks past the scan's
64-token chunks, the Mamba-2 state slots through preemption, and the config's layer list."""

from __future__ import annotations

import pytest

from engine.model_config import HFConfig
from engine.testing import recurrent
from engine.testing.generation import diverges_only_at_a_near_tie
from engine.testing.generation import greedy_tokens as greedy
from engine.testing.generation import hf_argmax_tokens as hf_greedy
from engine.testing.generation import random_prompts as prompts

PLUGINS = ["cpu", "nemotron_h"]
checkpoint = recurrent.checkpoint_fixture("NemotronHForCausalLM")


def test_24_greedy_tokens_of_a_batch_match_transformers(checkpoint):
    path, hf_model = checkpoint
    recurrent.check_greedy_tokens_match_transformers(path, PLUGINS, hf_model, 24)


def test_bf16_greedy_tokens_match_transformers_for_32_steps(tmp_path):
    """In bf16 the two compute in different orders (the backend's float32 convolution and time
    steps, fused projections, the CPU's GEMM kernels), so a near tie of a random model's logits
    may break either way: every prompt agrees up to a near tie, and at least two of three
    agree for all 32."""
    from engine.testing.checkpoints import make_tiny_checkpoint

    hf_model = make_tiny_checkpoint("NemotronHForCausalLM", tmp_path / "bf16", dtype="bfloat16")
    batch = prompts(4, lengths=(6, 29, 40))
    ours = greedy(recurrent.make_llm(tmp_path / "bf16", PLUGINS, dtype="bfloat16"), batch, 32)
    theirs = [hf_greedy(hf_model, prompt, 32) for prompt in batch]
    assert all(diverges_only_at_a_near_tie(hf_model, p, a, b) for p, a, b in zip(batch, ours, theirs))
    assert sum(a == b for a, b in zip(ours, theirs)) >= 2


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_prefill_in_chunks_equals_whole_prefill(checkpoint, chunk):
    """Prompts (one of 150 tokens, past two 64-token chunks of the scan) prefilled in steps of
    ``chunk`` tokens carry each request's SSM state and convolution inputs from step to step:
    the logits are those of one whole-prompt step, and those of transformers."""
    path, hf_model = checkpoint
    recurrent.check_chunked_prefill_equals_whole(path, PLUGINS, chunk, hf_model=hf_model)


@pytest.mark.parametrize("snapshots", [0, 6])
def test_preemption_returns_state_slots_and_keeps_outputs(checkpoint, snapshots):
    """Requests preempted by recompute give their state slot back and start afresh (with state
    snapshots: from their longest cached prefix); outputs are those of one request at a time."""
    recurrent.check_preemption_keeps_outputs(checkpoint[0], PLUGINS, snapshots)


def test_prefix_hits_on_two_tensor_parallel_ranks(checkpoint):
    """Both ranks copy their heads' Mamba-2 state into and out of the snapshot rows: prompts
    sharing a prefix, sent one after another to two ranks, give the greedy tokens of one rank
    without prefix caching."""
    recurrent.check_prefix_hits_on_two_tensor_parallel_ranks(checkpoint[0], PLUGINS)


def test_the_layer_list_reads_the_pattern_and_refuses_unknown_layers():
    from engine_nemotron_h.nemotron_h import layer_types

    assert layer_types(HFConfig({"hybrid_override_pattern": "M-*E"})) == (
        "linear_attention",
        "mlp",
        "full_attention",
        "moe",
    )
    assert layer_types(HFConfig({"layers_block_type": ["mlp", "linear_attention"]})) == ("mlp", "linear_attention")
    with pytest.raises(ValueError, match=r"layer symbols \['S'\]"):
        layer_types(HFConfig({"hybrid_override_pattern": "M*S"}))
    with pytest.raises(ValueError, match=r"layer types \['sliding_attention'\]"):
        layer_types(HFConfig({"layers_block_type": ["sliding_attention"]}))


def test_an_unsupported_activation_is_refused(tmp_path):
    from engine.testing.checkpoints import TINY_CONFIGS
    from engine_nemotron_h.nemotron_h import Dims

    config = HFConfig({**TINY_CONFIGS["NemotronHForCausalLM"], "mlp_hidden_act": "silu"})
    with pytest.raises(ValueError, match="mlp_hidden_act must be 'relu2'"):
        Dims.from_config(config)


def test_groups_of_b_and_c_split_over_the_ranks_or_are_shared_whole():
    """Two ranks: four groups split two and two, one group replicated on both, three groups refused."""
    from engine.distributed import TensorParallel
    from engine_nemotron_h.nemotron_h import group_split

    second = TensorParallel(rank=1, size=2)
    assert group_split(second, 4) == (2, 2)
    assert group_split(second, 1) == (0, 1)
    with pytest.raises(ValueError, match=r"n_groups \(3\) is neither 1 nor divisible by the tensor-parallel size 2"):
        group_split(second, 3)
