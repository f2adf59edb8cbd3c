"""Qwen3.5 against transformers on the same random weights, beyond the kit: greedy generation
of a batch (fp32, and bf16 for 32 steps), prefill in chunks, the DeltaNet state slots through
preemption, and the gated attention's pieces."""

from __future__ import annotations

import pytest
import torch

from engine.testing import recurrent
from engine.testing.generation import diverges_only_at_a_near_tie
from engine.testing.generation import greedy_tokens as greedy
from engine.testing.generation import hf_argmax_tokens as hf_greedy
from engine.testing.generation import random_prompts as prompts

PLUGINS = ["cpu", "qwen"]
checkpoint = recurrent.checkpoint_fixture("Qwen3_5ForCausalLM")


def test_24_greedy_tokens_of_a_batch_match_transformers(checkpoint):
    path, hf_model = checkpoint
    recurrent.check_greedy_tokens_match_transformers(path, PLUGINS, hf_model, 24)


def test_bf16_greedy_tokens_match_transformers_for_32_steps(tmp_path):
    """In bf16 the two compute in different orders (fused projections, the backend's float32
    convolution, the CPU's GEMM kernels), so a near tie of a random model's logits may break
    either way (on an Intel Xeon with AMX one prompt meets an exact tie of transformers' bf16
    logits at token 14): every prompt agrees up to a near tie, and at least three of five agree
    for all 32."""
    from engine.testing.checkpoints import make_tiny_checkpoint

    hf_model = make_tiny_checkpoint("Qwen3_5ForCausalLM", tmp_path / "bf16", dtype="bfloat16")
    batch = prompts(4, lengths=(6, 17, 29, 12, 40))
    ours = greedy(recurrent.make_llm(tmp_path / "bf16", PLUGINS, dtype="bfloat16"), batch, 32)
    theirs = [hf_greedy(hf_model, prompt, 32) for prompt in batch]
    assert all(diverges_only_at_a_near_tie(hf_model, p, a, b) for p, a, b in zip(batch, ours, theirs))
    assert sum(a == b for a, b in zip(ours, theirs)) >= 3


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_prefill_in_chunks_equals_whole_prefill(checkpoint, chunk):
    """Prompts (one of 150 tokens, past a 64-token chunk of the chunked form) prefilled in steps
    of ``chunk`` tokens carry each request's DeltaNet state and convolution inputs from step to
    step: the logits are those of one whole-prompt step."""
    recurrent.check_chunked_prefill_equals_whole(checkpoint[0], PLUGINS, chunk)


@pytest.mark.parametrize("snapshots", [0, 6])
def test_preemption_returns_state_slots_and_keeps_outputs(checkpoint, snapshots):
    """Requests preempted by recompute give their state slot back and start afresh (with state
    snapshots: from their longest cached prefix); outputs are those of one request at a time."""
    recurrent.check_preemption_keeps_outputs(checkpoint[0], PLUGINS, snapshots)


def test_prefix_hits_on_two_tensor_parallel_ranks(checkpoint):
    """Both ranks copy the DeltaNet state into and out of the snapshot rows: prompts sharing a
    prefix, sent one after another to two ranks, give the greedy tokens of one rank without
    prefix caching."""
    recurrent.check_prefix_hits_on_two_tensor_parallel_ranks(checkpoint[0], PLUGINS)


def test_key_heads_are_repeated_for_the_value_heads_they_serve():
    """With two key heads for four value heads, value heads 0 and 1 read key head 0, 2 and 3 key
    head 1 (transformers' repeat_interleave)."""
    from engine_qwen.qwen3_5 import repeat_heads

    q = torch.arange(2 * 3, dtype=torch.float32).view(1, 6)
    assert torch.equal(repeat_heads(q, 2, 3, 2).view(4, 3), q.view(2, 3)[[0, 0, 1, 1]])
