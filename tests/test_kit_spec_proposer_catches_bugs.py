"""SpecProposerTests fails a broken proposer: each deliberately broken variant of the
ngram proposer below is caught by the kit checks named next to it, and the real one
passes them all."""

from __future__ import annotations

import sys
from pathlib import Path

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))
from plugin_helpers import assert_broken_caught_and_good_passes, kit_subclasses, run_kit_in_subprocess  # noqa: E402

pytest_plugins = ["pytester"]

PLUGIN = '''
import torch

import engine
from engine.interfaces.spec_proposer import Drafts
from engine.spec_decode.ngram import NgramProposer


class Good(NgramProposer):
    name = "good"


class Leaky(NgramProposer):
    """drafts token 7 and claims it had almost no chance of drafting it: its drafts get
    accepted nearly always and leak into sampled output"""
    name = "leaky"

    def propose(self, requests, num_tokens, hidden_states=None):
        vocab = self.init.vocab_size
        probs = torch.full((num_tokens, vocab), 1.0 / (vocab - 1))
        probs[:, 7] = 0.0
        return Drafts([[7] * num_tokens for _ in requests], [probs.clone() for _ in requests])


class TooMany(NgramProposer):
    """ignores num_tokens"""
    name = "too_many"

    def propose(self, requests, num_tokens, hidden_states=None):
        return Drafts([[1] * (num_tokens + 2) for _ in requests])


class OutOfVocab(NgramProposer):
    """drafts an id past the vocabulary"""
    name = "out_of_vocab"

    def propose(self, requests, num_tokens, hidden_states=None):
        return Drafts([[self.init.vocab_size] for _ in requests])


class Misaligned(NgramProposer):
    """drops the last request's list"""
    name = "misaligned"

    def propose(self, requests, num_tokens, hidden_states=None):
        return Drafts(super().propose(requests, num_tokens).token_ids[:-1])


class Forgetful(NgramProposer):
    """assumes a request's tokens only ever grow"""
    name = "forgetful"

    def __init__(self, init):
        super().__init__(init)
        self.seen = {}

    def propose(self, requests, num_tokens, hidden_states=None):
        for r in requests:
            before = self.seen.get(r.request_id, 0)
            assert len(r.token_ids) >= before, "tokens shrank"
            self.seen[r.request_id] = len(r.token_ids)
        return super().propose(requests, num_tokens)


class Reversed(NgramProposer):
    """drafts for the batch back to front: every request gets another's drafts"""
    name = "reversed"

    def propose(self, requests, num_tokens, hidden_states=None):
        return Drafts(super().propose(requests[::-1], num_tokens).token_ids)


class StaleBigram(NgramProposer):
    """a table of each request's bigrams, fed only the tokens past those it has seen: rejected
    drafts stay in it, and tokens that replace them are never read"""
    name = "stale_bigram"

    def __init__(self, init):
        super().__init__(init)
        self.tables = {}

    def propose(self, requests, num_tokens, hidden_states=None):
        drafts = []
        for r in requests:
            seen, table = self.tables.get(r.request_id, (0, {}))
            for i in range(max(seen, 1), len(r.token_ids)):
                table[r.token_ids[i - 1]] = r.token_ids[i]
            self.tables[r.request_id] = (max(seen, len(r.token_ids)), table)
            draft, last = [], r.token_ids[-1]
            while len(draft) < num_tokens and last in table:
                last = table[last]
                draft.append(last)
            drafts.append(draft)
        return Drafts(drafts)

    def remove(self, request_ids):
        for request_id in request_ids:
            self.tables.pop(request_id, None)


class ColumnSoftmax(NgramProposer):
    """normalizes its draft distributions over the wrong dimension"""
    name = "column_softmax"

    def propose(self, requests, num_tokens, hidden_states=None):
        drafts = super().propose(requests, num_tokens).token_ids
        gen = torch.Generator().manual_seed(0)
        probs = [torch.randn(len(d), self.init.vocab_size, generator=gen).softmax(dim=0) for d in drafts]
        return Drafts(drafts, probs)


class WrongProbsShape(NgramProposer):
    """one probability row per asked-for draft, not per draft made"""
    name = "wrong_probs_shape"

    def propose(self, requests, num_tokens, hidden_states=None):
        drafts = super().propose(requests, num_tokens).token_ids
        probs = [torch.full((num_tokens, self.init.vocab_size), 1.0 / self.init.vocab_size) for _ in drafts]
        return Drafts(drafts, probs)


class StrictRemove(NgramProposer):
    """keeps a record per request and fails to remove one it never drafted for"""
    name = "strict_remove"

    def __init__(self, init):
        super().__init__(init)
        self.calls = {}

    def propose(self, requests, num_tokens, hidden_states=None):
        for r in requests:
            self.calls[r.request_id] = self.calls.get(r.request_id, 0) + 1
        return super().propose(requests, num_tokens)

    def remove(self, request_ids):
        for request_id in request_ids:
            del self.calls[request_id]


@engine.hookimpl
def register_spec_proposers(register):
    for cls in (
        Good, Leaky, TooMany, OutOfVocab, Misaligned, Forgetful,
        Reversed, StaleBigram, ColumnSoftmax, WrongProbsShape, StrictRemove,
    ):
        register(cls)
'''

# broken variant -> the kit checks that must fail for it
CAUGHT_BY = {
    "leaky": ("test_sampled_tokens_follow_the_target_distribution",),
    "too_many": ("test_drafts_follow_the_contract", "test_greedy_output_is_the_target_output"),
    "out_of_vocab": ("test_drafts_follow_the_contract", "test_greedy_output_is_the_target_output"),
    "misaligned": ("test_drafts_follow_the_contract", "test_greedy_output_is_the_target_output"),
    "forgetful": ("test_copes_with_rollback_and_removal",),
    "reversed": ("test_drafts_belong_to_their_request",),
    "stale_bigram": ("test_drafts_after_rollback_match_a_fresh_proposer",),
    "column_softmax": ("test_drafts_follow_the_contract",),
    "wrong_probs_shape": ("test_drafts_follow_the_contract",),
    "strict_remove": ("test_copes_with_rollback_and_removal",),
}

# the checks that generate with the target are slow: a broken variant runs them only where they catch it
GENERATING = ("test_greedy_output_is_the_target_output", "test_sampled_tokens_follow_the_target_distribution")
TESTS = kit_subclasses("SpecProposerTests", "broken_proposers", "proposer_name", ["good", *CAUGHT_BY]) + "".join(
    f"\nTest_{name}.{check} = None\n"
    for name, checks in CAUGHT_BY.items()
    for check in GENERATING
    if check not in checks
)


def test_every_broken_proposer_is_caught_by_its_check(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(pytester.path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    outcomes = run_kit_in_subprocess(pytester, broken_proposers=PLUGIN, test_proposer_kit=TESTS)
    assert_broken_caught_and_good_passes(outcomes, CAUGHT_BY, good_checks=7)
