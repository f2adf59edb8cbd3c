"""Speculative decoding on Qwen3.5, whose DeltaNet layers keep a recurrent state: a step whose
drafts are partly rejected has run the state past tokens the request does not keep, so the
runner puts each drafted request's state back and the kept tokens are recomputed. Greedy
outputs are those without speculation, drafts accepted and rejected alike, through preemption."""

from __future__ import annotations

import pytest

from engine.testing import recurrent

PLUGINS = ["cpu", "qwen"]


@pytest.fixture(autouse=True)
def flat_step_costs(monkeypatch):
    recurrent.flat_step_costs(monkeypatch)


checkpoint = recurrent.checkpoint_fixture("Qwen3_5ForCausalLM")


@pytest.mark.parametrize("max_num_seqs", [4, 1])
def test_ngram_speculation_gives_the_outputs_without_it(checkpoint, max_num_seqs, monkeypatch):
    """Also: the step that recomputes a rewound request's kept tokens drafts after them."""
    from engine.runtime.scheduler import Scheduler

    drafted_steps = []  # (tokens the request computes, drafts) of every drafted request
    plan = Scheduler._plan_drafts

    def recording(self, batch):
        plan(self, batch)
        drafted_steps.extend((batch.num_tokens[i], len(d)) for i, d in batch.drafts.items())

    monkeypatch.setattr(Scheduler, "_plan_drafts", recording)
    recurrent.check_ngram_speculation_keeps_outputs(checkpoint[0], PLUGINS, max_num_seqs)
    assert any(n > 1 for n, _ in drafted_steps)


def test_speculation_through_preemption_keeps_the_outputs(checkpoint):
    """A cache of a few blocks: requests take turns, preempted ones start afresh with drafts."""
    recurrent.check_speculation_through_preemption(checkpoint[0], PLUGINS)


def test_speculation_on_requests_starting_from_state_snapshots(checkpoint):
    """Chat-like turns, each prompt the previous turn's prompt and output plus a new phrase, sent
    one after another: every turn after the first starts from a snapshot of the DeltaNet state
    and drafts from there; the outputs are those without speculation or prefix caching."""
    recurrent.check_speculation_from_state_snapshots(checkpoint[0], PLUGINS)
