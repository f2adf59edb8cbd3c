"""Kimi Linear against transformers on the same random weights (fp32), beyond the kit: greedy
generation of a batch, prefill in chunks of 1, 5 and 64 tokens, the recurrent-state slots
through preemption (with and without state snapshots), finish and abort."""

from __future__ import annotations

import logging

import pytest

from engine import LLM, SamplingParams
from engine.testing.generation import greedy_tokens as greedy
from engine.testing.generation import hf_argmax_tokens
from engine.testing.generation import random_prompts as prompts

PLUGINS = ["cpu", "kimi_k3"]


def make_llm(path, **kwargs) -> LLM:
    return LLM(
        str(path), **{"plugins": PLUGINS, "dtype": "float32", "kv_cache_memory": 0.02, "progress": False, **kwargs}
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from engine.testing.checkpoints import make_tiny_checkpoint

    path = tmp_path_factory.mktemp("kimi_linear")
    return path, make_tiny_checkpoint("KimiLinearForCausalLM", path)


def test_24_greedy_tokens_of_a_batch_match_transformers(checkpoint):
    """Against transformers' argmax over its forward of each growing sequence."""
    path, hf_model = checkpoint
    batch = prompts(0)
    for prompt, tokens in zip(batch, greedy(make_llm(path), batch, 24)):
        assert tokens == hf_argmax_tokens(hf_model, prompt, 24)


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_prefill_in_chunks_equals_whole_prefill(checkpoint, chunk):
    """Prompts (one of 150 tokens, past a 64-token chunk of the chunked form) prefilled in steps of
    ``chunk`` tokens continue each request's state from step to step: the logits are those of one
    whole-prompt step."""
    path, _ = checkpoint
    batch = prompts(1, lengths=(9, 150, 33))
    whole = make_llm(path).prompt_logits(batch)
    chunked = make_llm(path, max_num_batched_tokens=chunk, max_num_seqs=3).prompt_logits(batch)
    for a, b in zip(whole, chunked):
        assert (a - b).abs().max().item() <= 1e-4 * max(1.0, a.abs().max().item())


@pytest.mark.parametrize("snapshots", [0, 6])
def test_preemption_returns_state_slots_and_keeps_outputs(checkpoint, caplog, snapshots):
    """Requests preempted by recompute give their state slot back and start afresh (or, with
    state snapshots, from the snapshot of their longest cached prefix); the outputs are those
    of one request at a time, and after the run every slot is free again. Without snapshots
    prefix caching is off for the hybrid model, and says so."""
    path, _ = checkpoint
    batch = prompts(2, lengths=(9, 33, 50, 21, 40))
    expected = greedy(make_llm(path, max_num_seqs=1), batch, 30)
    specs = make_llm(path).engine.model.kv_cache_specs()
    row = sum(spec.state_numel() * 4 for spec in specs if spec.is_recurrent)  # float32
    blocks = 12 * 16 * sum(spec.kv_bytes_per_token(4) for spec in specs)  # the MLA layer's paged entries
    with caplog.at_level(logging.INFO, logger="engine"):
        # 12 blocks of 16 tokens: five requests of up to 80 tokens must take turns
        llm = make_llm(
            path,
            kv_cache_memory=((5 + snapshots) * row + blocks) / 2**30,
            max_model_len=128,
            max_num_seqs=5,
            num_state_snapshots=snapshots,
            state_snapshot_interval=16,
        )
    manager = llm.engine.kv_manager
    assert manager.num_blocks == 12 and manager.num_state_snapshots == snapshots
    if not snapshots:
        assert "prefix caching is off for KimiLinearForCausalLM" in caplog.text
        assert not manager.enable_prefix_caching
    assert greedy(llm, batch, 30) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert sorted(manager.free_state_slots) == list(range(manager.num_state_slots))
    if snapshots:  # the recomputed requests found their own snapshots
        assert manager.snapshot_stats.restored > 0


def test_abort_returns_the_state_slot(checkpoint):
    path, _ = checkpoint
    llm = make_llm(path, max_num_seqs=4)
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
    assert sorted(engine.kv_manager.free_state_slots) == list(range(engine.kv_manager.num_state_slots))


def test_ngram_speculation_rewinds_the_kda_state_and_keeps_the_outputs(checkpoint, monkeypatch):
    """Drafts partly rejected have run each KDA state past tokens the request does not keep: the
    runner puts the state back and the kept tokens are recomputed; the outputs are those
    without speculation. Every step costs the same to the adaptive budget, so which drafts are
    verified does not depend on the machine's timings."""
    from engine.spec_decode.budget import StepCostTable

    monkeypatch.setattr(StepCostTable, "estimate", lambda self, num_tokens: 1.0)
    path, _ = checkpoint
    phrases = [[17, 45, 9, 101, 33], [200, 7, 7, 64], [5, 90, 12, 250, 31, 8]]
    batch = [(phrase * 6)[: 12 + 5 * i] for i, phrase in enumerate(phrases)]
    expected = greedy(make_llm(path), batch, 120)  # long enough for the random model to fall into loops
    llm = make_llm(path, speculative_method="ngram", num_speculative_tokens=3)
    assert greedy(llm, batch, 120) == expected
    stats = llm.engine.spec.stats
    assert 0 < stats.accepted < stats.proposed and llm.engine.shard.runner.rewinds > 0
