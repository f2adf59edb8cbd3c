"""The engine's reasoning tracker (engine.runtime.reasoning) against a plain reading of the
finished output: where the reasoning block is, how many tokens it holds, and, under a
thinking budget, that it never holds more and is closed by the forced tokens."""

from __future__ import annotations

import random

import pytest

from engine.runtime.reasoning import Phase, ReasoningTracker
from engine.sampling_params import ReasoningMarkers, SamplingParams

START, END, FORCED = (1, 2), (3, 4), (3, 4, 5)
ALPHABET = [1, 2, 3, 4, 5, 6, 7]


def find(tokens: list[int], marker: tuple[int, ...], start: int = 0) -> int:
    for i in range(start, len(tokens) - len(marker) + 1):
        if tuple(tokens[i : i + len(marker)]) == marker:
            return i
    return -1


def reference(output: list[int], starts_open: bool) -> tuple[int, int | None]:
    """(index where the reasoning begins, or -1 when there is none; its length in tokens, or
    None when the output has no reasoning)"""
    if starts_open:
        begin = 0
    elif tuple(output[: len(START)]) == START:
        begin = len(START)
    else:
        return -1, None
    close = find(output, END, begin)
    return begin, (close if close >= 0 else len(output)) - begin


def run(sampled: list[int], starts_open: bool, budget: int | None) -> tuple[list[int], ReasoningTracker]:
    tracker = ReasoningTracker(ReasoningMarkers(START, END, FORCED, starts_open), budget)
    output = []
    for token in sampled:
        token = tracker.substitute(token)
        tracker.observe(token)
        output.append(token)
    return output, tracker


@pytest.mark.parametrize("starts_open", [False, True])
def test_counts_match_a_plain_reading_of_the_output(starts_open):
    rng = random.Random(starts_open)
    for _ in range(3000):
        length = rng.randint(0, 30)
        sampled = [rng.choice(ALPHABET) for _ in range(length)]
        if not starts_open and rng.random() < 0.7:
            sampled[:2] = list(START)[: len(sampled)]
        budget = rng.choice([None, rng.randint(0, 12)])
        output, tracker = run(sampled, starts_open, budget)
        begin, count = reference(output, starts_open)
        closed = count is not None and find(output, END, max(begin, 0)) >= 0
        if count is None:
            assert tracker.num_reasoning_tokens == 0, (sampled, output)
            continue
        assert tracker.phase is (Phase.AFTER if closed else Phase.IN), (sampled, output)
        if budget is not None and count > budget:
            # cut short while the engine wrote the closing tokens: those are not reasoning
            assert FORCED[: count - budget] == tuple(output[begin + budget :]), (sampled, output, budget)
            assert tracker.num_reasoning_tokens == budget
            continue
        assert tracker.num_reasoning_tokens == count, (sampled, output, budget)
        if budget is not None and count == budget and len(output) >= begin + budget + len(FORCED):
            # the model had not closed its reasoning by the budget: the engine wrote the closing tokens
            assert tuple(output[begin + budget : begin + budget + len(FORCED)]) == FORCED, (sampled, output)
        if budget is None:
            assert output == sampled  # nothing is replaced without a budget


def test_the_output_is_the_sampled_one_until_the_budget_is_spent():
    sampled = [1, 2, 6, 6, 6, 6, 7, 7]
    output, tracker = run(sampled, False, 3)
    assert output == [1, 2, 6, 6, 6, 3, 4, 5]
    assert tracker.num_reasoning_tokens == 3 and tracker.phase is Phase.AFTER and not tracker.may_force


def test_a_budget_of_zero_closes_at_once():
    output, tracker = run([6, 6, 6, 6], True, 0)
    assert output == [3, 4, 5, 6] and tracker.num_reasoning_tokens == 0


def test_an_output_that_does_not_open_reasoning_is_left_alone():
    output, tracker = run([6, 1, 2, 6, 3, 4], False, 0)
    assert output == [6, 1, 2, 6, 3, 4] and tracker.phase is Phase.AFTER and tracker.num_reasoning_tokens == 0


@pytest.mark.parametrize(
    "fields, mentions",
    [
        ({"thinking_token_budget": 3}, "reasoning_markers"),
        ({"thinking_token_budget": -1, "reasoning_markers": ReasoningMarkers(START, END, FORCED)}, "at least 0"),
        ({"reasoning_markers": {"start": (), "end": END, "forced_end": FORCED}}, "reasoning_markers.start"),
        ({"reasoning_markers": {"start": START, "end": END, "forced_end": (5, 3, 4)}}, "begin with"),
    ],
)
def test_bad_reasoning_parameters(fields, mentions):
    with pytest.raises(ValueError, match=mentions):
        SamplingParams(**fields)
