"""Speculative decoding on Nemotron-H, whose Mamba-2 layers keep a recurrent state: a step whose
drafts are partly rejected has run the state past tokens the request does not keep, so the
runner puts each drafted request's state back and the kept tokens are recomputed. Greedy
outputs are those without speculation, drafts accepted and rejected alike, through preemption
and from state snapshots."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
PLUGINS = ["cpu", "nemotron_h"]


def repetitive_prompts() -> list[list[int]]:
    """Prompts made of repeated phrases, so the n-gram proposer finds drafts."""
    phrases = [[17, 45, 9, 101, 33], [200, 7, 7, 64], [5, 90, 12, 250, 31, 8]]
    return [(phrase * 6)[: 12 + 5 * i] for i, phrase in enumerate(phrases)] + [[3, 4, 5, 6] * 3]


def generate(path, **kwargs) -> tuple[list[list[int]], LLM]:
    settings = {"plugins": PLUGINS, "dtype": "float32", "kv_cache_memory": 0.02, "progress": False, **kwargs}
    llm = LLM(str(path), **settings)
    return [o.outputs[0].token_ids for o in llm.generate(repetitive_prompts(), PARAMS, use_tqdm=False)], llm


@pytest.fixture(autouse=True)
def flat_step_costs(monkeypatch):
    """Every step costs the same to the adaptive budget, so drafts are always verified: which
    drafts a step takes then depends on the outputs alone, never on the machine's timings."""
    from engine.spec_decode.budget import StepCostTable

    monkeypatch.setattr(StepCostTable, "estimate", lambda self, num_tokens: 1.0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from engine.testing.checkpoints import make_tiny_checkpoint

    path = tmp_path_factory.mktemp("nemotron_h_spec")
    make_tiny_checkpoint("NemotronHForCausalLM", path)
    return path


@pytest.mark.parametrize("max_num_seqs", [4, 1])
def test_ngram_speculation_gives_the_outputs_without_it(checkpoint, max_num_seqs):
    expected, _ = generate(checkpoint, max_num_seqs=max_num_seqs)
    got, llm = generate(checkpoint, max_num_seqs=max_num_seqs, speculative_method="ngram", num_speculative_tokens=3)
    assert got == expected
    stats = llm.engine.spec.stats
    assert stats.accepted > 0 and stats.accepted < stats.proposed  # drafts kept and drafts rejected
    assert llm.engine.shard.runner.rewinds > 0
    manager = llm.engine.kv_manager
    assert sorted(manager.free_state_slots) == list(range(manager.num_state_slots))


def test_speculation_through_preemption_keeps_the_outputs(checkpoint):
    """A cache of a few blocks: requests take turns, preempted ones start afresh with drafts."""
    expected, _ = generate(checkpoint, max_num_seqs=1)
    probe = generate(checkpoint)[1].engine.model.kv_cache_specs()
    states = 4 * sum(spec.state_numel() * 4 for spec in probe if spec.is_recurrent)
    blocks = 9 * 16 * sum(spec.kv_bytes_per_token(4) for spec in probe)
    got, llm = generate(
        checkpoint,
        kv_cache_memory=(states + blocks) / 2**30,
        max_model_len=80,
        max_num_seqs=4,
        speculative_method="ngram",
        num_speculative_tokens=3,
    )
    assert got == expected
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.shard.runner.rewinds > 0


def test_speculation_on_requests_starting_from_state_snapshots(checkpoint):
    """Chat-like turns, each prompt the previous turn's prompt and output plus a new phrase, sent
    one after another: every turn after the first starts from a snapshot of the Mamba-2 state
    and drafts from there; the outputs are those without speculation or prefix caching."""

    def turns(**kwargs) -> tuple[list[list[int]], LLM]:
        settings = {"plugins": PLUGINS, "dtype": "float32", "kv_cache_memory": 0.02, "progress": False}
        llm = LLM(str(checkpoint), **settings, **kwargs)
        prompt, outputs = repetitive_prompts()[0], []
        for phrase in ([1, 2, 3], [4, 5], [6, 7, 8, 9]):
            tokens = llm.generate([prompt], PARAMS, use_tqdm=False)[0].outputs[0].token_ids
            outputs.append(tokens)
            prompt = prompt + tokens + phrase
        return outputs, llm

    expected, _ = turns(enable_prefix_caching=False)
    got, llm = turns(block_size=4, state_snapshot_interval=8, speculative_method="ngram", num_speculative_tokens=3)
    assert got == expected
    assert llm.engine.kv_manager.snapshot_stats.restored == 2
    assert llm.engine.spec.stats.accepted > 0
