"""StructuredOutputBackendTests fails a broken backend: each deliberately broken variant of
the xgrammar backend below is caught by the kit check named next to it, and the real
xgrammar backend passes them all."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))
from plugin_helpers import assert_broken_caught_and_good_passes, kit_subclasses, run_kit_in_subprocess  # noqa: E402

pytest.importorskip("engine_xgrammar")

pytest_plugins = ["pytester"]

PLUGIN = '''
import torch

import engine
from engine.interfaces.structured_output import ConstraintError
from engine_xgrammar.backend import XGrammarBackend, XGrammarMatcher


def allow(bitmask, row, tokens):
    """Set the bits of ``tokens`` in ``bitmask[row]``."""
    words = bitmask[row]
    for token in tokens:
        word, bit = divmod(token, 32)
        value = (int(words[word]) & 0xFFFFFFFF) | (1 << bit)
        words[word] = value - (1 << 32) if value >= 1 << 31 else value


class Good(XGrammarBackend):
    name = "good"


class EarlyEndMatcher(XGrammarMatcher):
    def fill_bitmask(self, bitmask, row):
        super().fill_bitmask(bitmask, row)
        allow(bitmask, row, self._eos)

    def can_terminate(self):
        return not self.is_terminated()


class EarlyEnd(XGrammarBackend):
    """the mask allows EOS (and can_terminate says so) before the constraint can end"""
    name = "early_end"

    def matcher(self, compiled, max_rollback):
        return EarlyEndMatcher(compiled, self._usable, self.eos_token_ids)


class PastVocabMatcher(XGrammarMatcher):
    def fill_bitmask(self, bitmask, row):
        super().fill_bitmask(bitmask, row)
        allow(bitmask, row, range(len(self._usable) - 5, len(self._usable)))


class PastVocab(XGrammarBackend):
    """the mask allows the last ids of the model's vocabulary, which the tokenizer lacks"""
    name = "past_vocab"

    def matcher(self, compiled, max_rollback):
        return PastVocabMatcher(compiled, self._usable, self.eos_token_ids)


class StaleBitsMatcher(XGrammarMatcher):
    def fill_bitmask(self, bitmask, row):
        fresh = torch.zeros_like(bitmask[row : row + 1])
        super().fill_bitmask(fresh, 0)
        bitmask[row] |= fresh[0]


class StaleBits(XGrammarBackend):
    """the fill ORs its bits into the row, leaving what the row held before"""
    name = "stale_bits"

    def matcher(self, compiled, max_rollback):
        return StaleBitsMatcher(compiled, self._usable, self.eos_token_ids)


class Neighbour(XGrammarBackend):
    """the batched fill also clears the row after each matcher's"""
    name = "neighbour"

    def fill_bitmask(self, matchers, bitmask, rows):
        super().fill_bitmask(matchers, bitmask, rows)
        for row in rows:
            if row + 1 < bitmask.shape[0] and row + 1 not in rows:
                bitmask[row + 1].zero_()


class ShortRollbackMatcher(XGrammarMatcher):
    def rollback(self, num_tokens):
        super().rollback(max(0, num_tokens - 1))


class ShortRollback(XGrammarBackend):
    """rollback(n) rolls back one token fewer"""
    name = "short_rollback"

    def matcher(self, compiled, max_rollback):
        return ShortRollbackMatcher(compiled, self._usable, self.eos_token_ids)


class MovingValidateMatcher(XGrammarMatcher):
    def validate_tokens(self, tokens):
        count = 0
        while count < len(tokens) and self._accept(int(tokens[count])):
            count += 1
        return count


class MovingValidate(XGrammarBackend):
    """validate_tokens accepts the tokens it counts instead of only counting them"""
    name = "moving_validate"

    def matcher(self, compiled, max_rollback):
        return MovingValidateMatcher(compiled, self._usable, self.eos_token_ids)


class PartialAcceptMatcher(XGrammarMatcher):
    def accept_tokens(self, tokens):
        for token in tokens:
            self._accept(int(token))
        return True


class PartialAccept(XGrammarBackend):
    """accept_tokens skips a refused token and says every token was accepted"""
    name = "partial_accept"

    def matcher(self, compiled, max_rollback):
        return PartialAcceptMatcher(compiled, self._usable, self.eos_token_ids)


class SharedMatchers(XGrammarBackend):
    """every matcher of one compiled constraint is the same matcher"""
    name = "shared_matchers"

    def matcher(self, compiled, max_rollback):
        cache = self.__dict__.setdefault("_matchers", {})
        if id(compiled) not in cache:
            cache[id(compiled)] = (compiled, super().matcher(compiled, max_rollback))
        return cache[id(compiled)][1]


class WrongError(XGrammarBackend):
    """an invalid constraint raises RuntimeError instead of ConstraintError"""
    name = "wrong_error"

    def compile(self, constraint):
        try:
            return super().compile(constraint)
        except ConstraintError as exc:
            raise RuntimeError(str(exc)) from None


class BarsMatcher(XGrammarMatcher):
    barred = ()

    def fill_bitmask(self, bitmask, row):
        super().fill_bitmask(bitmask, row)
        for token in self.barred:
            word, bit = divmod(token, 32)
            value = int(bitmask[row, word]) & 0xFFFFFFFF & ~(1 << bit)
            bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value


class BarsSpaced(XGrammarBackend):
    """bars the merged tokens that begin with a space (" and", " b"), as a tokenizer table
    that mishandles the space marker does; every fill (batched too) goes through the matcher"""
    name = "bars_spaced"

    def __init__(self, init):
        super().__init__(init)
        pieces = init.tokenizer.convert_ids_to_tokens(list(range(len(init.tokenizer))))
        self.barred = [i for i, piece in enumerate(pieces) if len(piece) > 1 and piece.startswith("\u0120")]

    def matcher(self, compiled, max_rollback):
        matcher = BarsMatcher(compiled, self._usable, self.eos_token_ids)
        matcher.barred = self.barred
        return matcher

    def fill_bitmask(self, matchers, bitmask, rows):
        for matcher, row in zip(matchers, rows):
            matcher.fill_bitmask(bitmask, row)


class BarsMergedDigits(BarsSpaced):
    """bars the merged tokens of digits ("12", "34")"""
    name = "bars_merged_digits"

    def __init__(self, init):
        super().__init__(init)
        pieces = init.tokenizer.convert_ids_to_tokens(list(range(len(init.tokenizer))))
        self.barred = [i for i, piece in enumerate(pieces) if len(piece) > 1 and piece.isdigit()]


@engine.hookimpl
def register_structured_output_backends(register):
    for cls in (Good, EarlyEnd, PastVocab, StaleBits, Neighbour, ShortRollback, MovingValidate, PartialAccept,
                SharedMatchers, WrongError, BarsSpaced, BarsMergedDigits):
        register(cls)
'''

# broken variant -> the kit checks that must fail for it
CAUGHT_BY = {
    "early_end": (
        "test_random_walks_satisfy_the_reference[json-nested_object]",
        "test_special_tokens_are_not_text[regex]",
    ),
    "past_vocab": ("test_random_walks_satisfy_the_reference[regex-0]",),
    "stale_bits": ("test_random_walks_satisfy_the_reference[choice-0]", "test_validate_rollback_and_reset"),
    "neighbour": ("test_batched_fill_matches_single_fills",),
    "short_rollback": ("test_validate_rollback_and_reset",),
    "moving_validate": ("test_validate_rollback_and_reset",),
    "partial_accept": ("test_disallowed_token_is_refused",),
    "shared_matchers": ("test_compiled_constraint_is_reusable",),
    "wrong_error": ("test_invalid_constraint_is_refused[regex-unbalanced]",),
    "bars_spaced": ("test_valid_outputs_are_allowed[regex-2]", "test_valid_outputs_are_allowed[choice-1]"),
    "bars_merged_digits": (
        "test_valid_outputs_are_allowed[json-nested_object]",
        "test_valid_outputs_are_allowed[grammar-0]",
    ),
}

TESTS = kit_subclasses("StructuredOutputBackendTests", "broken_backends", "backend_name", ["good", *CAUGHT_BY])


def test_every_broken_backend_is_caught_by_its_check(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(pytester.path))
    outcomes = run_kit_in_subprocess(pytester, broken_backends=PLUGIN, test_backend_kit=TESTS)
    # xgrammar compiles every constraint kind: none of the 63 checks is skipped
    assert_broken_caught_and_good_passes(outcomes, CAUGHT_BY, good_checks=63)
