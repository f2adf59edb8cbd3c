"""How many drafts each request gets: the adaptive speculative budget.

Each request keeps an estimate ``α`` of the chance that its next draft is accepted
(an exponentially weighted average over the drafts it had verified, starting from the
same average over every request so far, itself starting at ``INITIAL_ACCEPTANCE``: a
new request expects what the proposer has been delivering). Draft j of request i is a
*candidate* worth its expected accepted tokens, ``g = Π_{l≤j} c_l`` with ``c_l = α``
(or, when the proposer gives draft probabilities, the mean of ``α`` and the draft's own
probability).

A step's cost comes from a table of measured decode-step times (proposer time
included) by number of tokens computed: per size the median of its latest
``COST_SAMPLES`` steps, made non-decreasing in the size (timing noise must not make
drafts look free) and linear between measured sizes. Beyond the largest size measured,
a step counts as costing what that size does, so larger steps get tried and measured;
before any step was timed, steps count as equally costly.

Candidates are taken in order of ``g`` (at least ``MIN_GAIN`` each), and the step
carries the number of them that maximises its expected tokens per second,
``(sampled rows + Σ g) / t(tokens)`` — none when no number beats not speculating.
Costs are not smooth (a platform's kernels change at batch sizes), so every number is
weighed, not only the next one. A request offered drafts that were not taken is not
offered to the proposer again until it is due a probe of one draft, after
``PROBE_INTERVAL`` of its steps; each probe that fails doubles the interval (up to
``MAX_PROBE_INTERVAL``), and an accepted draft resets it. Probes run together, on
every ``PROBE_INTERVAL``-th engine step, so that a large batch pays for them on few
steps rather than a little on every one.
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque
from dataclasses import dataclass

INITIAL_ACCEPTANCE = 0.6
SMOOTHING = 0.8  # weight of the old estimate in each update
PROBE_INTERVAL = 16
MAX_PROBE_INTERVAL = 256
MIN_GAIN = 0.1  # a draft less likely than this to be kept is not worth proposing and verifying
COST_SAMPLES = 5  # latest steps of a size whose median is its cost


class StepCostTable:
    """Measured seconds of decode steps (no prompt tokens) by number of tokens computed."""

    def __init__(self) -> None:
        self.samples: dict[int, deque[float]] = {}
        self._curve: tuple[list[int], list[float]] | None = None  # sizes, non-decreasing costs

    def record(self, num_tokens: int, seconds: float) -> None:
        self.samples.setdefault(num_tokens, deque(maxlen=COST_SAMPLES)).append(seconds)
        self._curve = None

    def _costs(self) -> tuple[list[int], list[float]]:
        if self._curve is None:
            sizes = sorted(self.samples)
            costs, highest = [], 0.0
            for size in sizes:
                highest = max(highest, statistics.median(self.samples[size]))
                costs.append(highest)
            self._curve = (sizes, costs)
        return self._curve

    def estimate(self, num_tokens: int) -> float | None:
        """Seconds for a step of ``num_tokens``: linear between the measured sizes around it;
        beyond the largest measured size, that size's cost (optimistic, so that a larger
        step gets tried and measured); None before anything was measured."""
        sizes, costs = self._costs()
        if not sizes:
            return None
        i = bisect.bisect_left(sizes, num_tokens)
        if i == len(sizes):
            return costs[-1]
        if sizes[i] == num_tokens or i == 0:
            return costs[i]
        slope = (costs[i] - costs[i - 1]) / (sizes[i] - sizes[i - 1])
        return costs[i - 1] + slope * (num_tokens - sizes[i - 1])


@dataclass
class RequestEstimate:
    acceptance: float = INITIAL_ACCEPTANCE
    steps_without_drafts: int = 0
    probe_interval: int = PROBE_INTERVAL

    @property
    def due_probe(self) -> bool:
        return self.steps_without_drafts + 1 >= self.probe_interval


class SpecBudget:
    def __init__(self, max_drafts: int) -> None:
        self.max_drafts = max_drafts
        self.costs = StepCostTable()
        self.requests: dict[str, RequestEstimate] = {}
        self.acceptance = INITIAL_ACCEPTANCE  # over every request: a new request's prior
        self.steps = 0

    def estimate(self, request_id: str) -> RequestEstimate:
        estimate = self.requests.get(request_id)
        if estimate is None:
            estimate = self.requests[request_id] = RequestEstimate(acceptance=self.acceptance)
        return estimate

    def start_step(self) -> None:
        self.steps += 1

    @property
    def probe_step(self) -> bool:
        return self.steps % PROBE_INTERVAL == 0

    def _due_probe(self, estimate: RequestEstimate) -> bool:
        return self.probe_step and estimate.due_probe

    def wants_drafts(self, request_id: str) -> bool:
        """Whether to ask the proposer for this request: it had drafts verified last step
        (or is new), or it is due a probe. A request whose drafts did not pay off stops
        costing proposer time until then."""
        estimate = self.estimate(request_id)
        return estimate.steps_without_drafts == 0 or self._due_probe(estimate)

    def plan(
        self,
        request_ids: list[str],
        confidences: list[list[float | None]],
        num_sampled: int,
        base_tokens: int,
        limits: list[int],
    ) -> list[int]:
        """How many of each request's drafts to verify.

        ``confidences[i]``: per draft of request i, the proposer's probability of it or None;
        ``num_sampled``: rows that sample a token this step anyway; ``base_tokens``: tokens
        the step computes without drafts; ``limits[i]``: most drafts request i may take.
        """
        candidates = []  # (gain, request index, draft position)
        for i, (request_id, confidence) in enumerate(zip(request_ids, confidences)):
            alpha = self.estimate(request_id).acceptance
            gain = 1.0
            for j, c in enumerate(confidence[: min(self.max_drafts, limits[i])]):
                gain *= alpha if c is None else (alpha + c) / 2
                if gain < MIN_GAIN:
                    break
                candidates.append((gain, i, j))
        # a request's later drafts never gain more than its earlier ones: every prefix of this
        # order takes drafts in position order
        candidates.sort(key=lambda c: (-c[0], c[2]))
        best, best_rate, expected = 0, self._rate(num_sampled, base_tokens), float(num_sampled)
        for n, (gain, _, _) in enumerate(candidates, start=1):
            expected += gain
            rate = self._rate(expected, base_tokens + n)
            if rate > best_rate:
                best, best_rate = n, rate
        taken = [0] * len(request_ids)
        for _, i, _ in candidates[:best]:
            taken[i] += 1
        for i, request_id in enumerate(request_ids):
            estimate = self.estimate(request_id)
            if not confidences[i] or limits[i] == 0:
                continue  # nothing offered: the proposer had no drafts, which costs nothing to ask again
            if taken[i] == 0 and self._due_probe(estimate):
                taken[i] = 1
                estimate.probe_interval = min(2 * estimate.probe_interval, MAX_PROBE_INTERVAL)  # reset on acceptance
            estimate.steps_without_drafts = 0 if taken[i] else estimate.steps_without_drafts + 1
        return taken

    def _rate(self, expected_tokens: float, num_tokens: int) -> float:
        """Expected tokens per second of a step (before any step was timed: per step)."""
        cost = self.costs.estimate(num_tokens)
        return expected_tokens / max(cost, 1e-9) if cost is not None else expected_tokens

    def record(self, request_id: str, proposed: int, accepted: int) -> None:
        """Update the estimate from a verification: drafts 1..accepted were accepted and,
        when accepted < proposed, the next one was rejected (later ones are unobserved)."""
        estimate = self.estimate(request_id)
        observations = [1.0] * accepted + ([0.0] if accepted < proposed else [])
        for x in observations:
            estimate.acceptance = SMOOTHING * estimate.acceptance + (1 - SMOOTHING) * x
            self.acceptance = SMOOTHING * self.acceptance + (1 - SMOOTHING) * x
        if accepted:
            estimate.probe_interval = PROBE_INTERVAL

    def skip(self, request_id: str) -> None:
        """The request decoded without asking the proposer (not due a probe)."""
        self.estimate(request_id).steps_without_drafts += 1

    def remove(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
