"""Kimi Linear against transformers on the same random weights (fp32), beyond the kit: greedy
generation of a batch, prefill in chunks of 1, 5 and 64 tokens, the recurrent-state slots
through preemption (with and without state snapshots), finish and abort."""

from __future__ import annotations

import logging

import pytest

from engine import SamplingParams
from engine.testing import recurrent
from engine.testing.generation import greedy_tokens as greedy
from engine.testing.generation import random_prompts as prompts

PLUGINS = ["cpu", "kimi_k3"]
checkpoint = recurrent.checkpoint_fixture("KimiLinearForCausalLM")


def test_24_greedy_tokens_of_a_batch_match_transformers(checkpoint):
    """Against transformers' argmax over its forward of each growing sequence."""
    path, hf_model = checkpoint
    recurrent.check_greedy_tokens_match_transformers(path, PLUGINS, hf_model, 24)


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_prefill_in_chunks_equals_whole_prefill(checkpoint, chunk):
    """Prompts (one of 150 tokens, past a 64-token chunk of the chunked form) prefilled in steps of
    ``chunk`` tokens continue each request's state from step to step: the logits are those of one
    whole-prompt step."""
    recurrent.check_chunked_prefill_equals_whole(checkpoint[0], PLUGINS, chunk)


@pytest.mark.parametrize("snapshots", [0, 6])
def test_preemption_returns_state_slots_and_keeps_outputs(checkpoint, caplog, snapshots):
    """Requests preempted by recompute give their state slot back and start afresh (or, with
    state snapshots, from the snapshot of their longest cached prefix); the outputs are those
    of one request at a time, and after the run every slot is free again. Without snapshots
    prefix caching is off for the hybrid model, and says so."""
    with caplog.at_level(logging.INFO, logger="engine"):
        llm = recurrent.check_preemption_keeps_outputs(checkpoint[0], PLUGINS, snapshots)
    manager = llm.engine.kv_manager
    assert manager.num_state_snapshots == snapshots
    if not snapshots:
        assert "prefix caching is off for KimiLinearForCausalLM" in caplog.text
        assert not manager.enable_prefix_caching


def test_abort_returns_the_state_slot(checkpoint):
    path, _ = checkpoint
    llm = recurrent.make_llm(path, PLUGINS, max_num_seqs=4)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    for i, prompt in enumerate(prompts(3)):
        engine.add_request(f"r{i}", prompt, params)
    for _ in range(3):
        engine.step()
    held = {r.request_id: r.state_slot for r in engine.scheduler.running}
    assert len(held) == 4 and len(set(held.values())) == 4
    engine.abort("r1")
    assert held["r1"] in engine.kv_manager.free_state_slots
    while engine.has_unfinished():
        engine.step()
    assert recurrent.all_state_slots_free(llm)


def test_ngram_speculation_rewinds_the_kda_state_and_keeps_the_outputs(checkpoint, monkeypatch):
    """Drafts partly rejected have run each KDA state past tokens the request does not keep: the
    runner puts the state back and the kept tokens are recomputed; the outputs are those
    without speculation. Every step costs the same to the adaptive budget, so which drafts are
    verified does not depend on the machine's timings."""
    recurrent.flat_step_costs(monkeypatch)
    path, _ = checkpoint
    batch = recurrent.repetitive_prompts()[:3]
    expected = greedy(
        recurrent.make_llm(path, PLUGINS), batch, 120
    )  # long enough for the random model to fall into loops
    llm = recurrent.make_llm(path, PLUGINS, speculative_method="ngram", num_speculative_tokens=3)
    assert greedy(llm, batch, 120) == expected
    stats = llm.engine.spec.stats
    assert 0 < stats.accepted < stats.proposed and llm.engine.shard.runner.rewinds > 0
