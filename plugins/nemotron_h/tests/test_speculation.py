"""Speculative decoding on Nemotron-H, whose Mamba-2 layers keep a recurrent state: a step whose
drafts are partly rejected has run the state past tokens the request does not keep, so the
runner puts each drafted request's state back and the kept tokens are recomputed. Greedy
outputs are those without speculation, drafts accepted and rejected alike, through preemption
and from state snapshots."""

from __future__ import annotations

import pytest

from engine.testing import recurrent

PLUGINS = ["cpu", "nemotron_h"]


@pytest.fixture(autouse=True)
def flat_step_costs(monkeypatch):
    recurrent.flat_step_costs(monkeypatch)


checkpoint = recurrent.checkpoint_fixture("NemotronHForCausalLM")


@pytest.mark.parametrize("max_num_seqs", [4, 1])
def test_ngram_speculation_gives_the_outputs_without_it(checkpoint, max_num_seqs):
    recurrent.check_ngram_speculation_keeps_outputs(checkpoint[0], PLUGINS, max_num_seqs)


def test_speculation_through_preemption_keeps_the_outputs(checkpoint):
    """A cache of a few blocks: requests take turns, preempted ones start afresh with drafts."""
    recurrent.check_speculation_through_preemption(checkpoint[0], PLUGINS)


def test_speculation_on_requests_starting_from_state_snapshots(checkpoint):
    """Chat-like turns, each prompt the previous turn's prompt and output plus a new phrase, sent
    one after another: every turn after the first starts from a snapshot of the Mamba-2 state
    and drafts from there; the outputs are those without speculation or prefix caching."""
    recurrent.check_speculation_from_state_snapshots(checkpoint[0], PLUGINS)
