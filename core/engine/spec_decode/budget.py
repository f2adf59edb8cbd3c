"""How many drafts each request gets: the adaptive speculative budget.

Each request keeps an estimate ``α`` of the chance that its next draft is accepted
(an exponentially weighted average over the drafts it had verified, starting at
``INITIAL_ACCEPTANCE``). Draft j of request i is a *candidate* worth its expected
accepted tokens, ``g = Π_{l≤j} c_l`` with ``c_l = α`` (or, when the proposer gives
draft probabilities, the mean of ``α`` and the draft's own probability). A step's cost
comes from a table of measured step times by number of tokens computed (filled as the
engine runs, proposer time included; a least-squares line through it estimates any
size, and with fewer than two sizes measured drafts count as free, so the first steps
explore). Candidates are admitted in order of ``g`` while the expected tokens
per second of the step, ``(sampled rows + Σ g) / t(tokens)``, rises and ``g`` is at
least ``MIN_GAIN``, so a step never carries drafts that are expected to make it slower
than not speculating. A request
with no draft admitted is not offered to the proposer again until, every
``PROBE_INTERVAL`` of its steps, it is probed with one draft, so that its estimate can
recover.
"""

from __future__ import annotations

from dataclasses import dataclass

INITIAL_ACCEPTANCE = 0.6
SMOOTHING = 0.8  # weight of the old estimate in each update
PROBE_INTERVAL = 16
MIN_GAIN = 0.1  # a draft less likely than this to be kept is not worth proposing and verifying
COST_SMOOTHING = 0.7


class StepCostTable:
    """Measured seconds per engine step by number of tokens computed."""

    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}

    def record(self, num_tokens: int, seconds: float) -> None:
        old = self.seconds.get(num_tokens)
        self.seconds[num_tokens] = seconds if old is None else COST_SMOOTHING * old + (1 - COST_SMOOTHING) * seconds

    def estimate(self, num_tokens: int) -> float | None:
        """Seconds for a step of ``num_tokens``: the least-squares line through the measured
        sizes, never falling with more tokens (timing noise must not make drafts look free
        or cheaper than nothing); None with fewer than two sizes measured."""
        if len(self.seconds) < 2:
            return None
        sizes = list(self.seconds)
        mean_x = sum(sizes) / len(sizes)
        mean_y = sum(self.seconds.values()) / len(sizes)
        spread = sum((x - mean_x) ** 2 for x in sizes)
        slope = max(0.0, sum((x - mean_x) * (self.seconds[x] - mean_y) for x in sizes) / spread)
        return max(1e-9, mean_y + slope * (num_tokens - mean_x))


@dataclass
class RequestEstimate:
    acceptance: float = INITIAL_ACCEPTANCE
    steps_without_drafts: int = 0


class SpecBudget:
    def __init__(self, max_drafts: int) -> None:
        self.max_drafts = max_drafts
        self.costs = StepCostTable()
        self.requests: dict[str, RequestEstimate] = {}

    def estimate(self, request_id: str) -> RequestEstimate:
        return self.requests.setdefault(request_id, RequestEstimate())

    def wants_drafts(self, request_id: str) -> bool:
        """Whether to ask the proposer for this request: it had drafts verified last step
        (or is new), or it is due a probe. A request whose drafts did not pay off stops
        costing proposer time until then."""
        estimate = self.estimate(request_id)
        return estimate.steps_without_drafts == 0 or estimate.steps_without_drafts + 1 >= PROBE_INTERVAL

    def plan(
        self, request_ids: list[str], confidences: list[list[float | None]], num_sampled: int, base_tokens: int,
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
                candidates.append((gain, i, j))
        candidates.sort(key=lambda c: (-c[0], c[2]))
        taken = [0] * len(request_ids)
        expected, tokens = float(num_sampled), base_tokens
        base_cost = self.costs.estimate(tokens)
        rate = expected / base_cost if base_cost else 0.0
        for gain, i, j in candidates:
            if gain < MIN_GAIN:
                break
            if j != taken[i]:  # a later draft only after the earlier ones
                continue
            cost = self.costs.estimate(tokens + 1)
            new_rate = (expected + gain) / cost if cost else None
            if new_rate is not None and new_rate <= rate:
                break
            taken[i] += 1
            expected, tokens = expected + gain, tokens + 1
            rate = new_rate if new_rate is not None else rate
        for i, request_id in enumerate(request_ids):
            estimate = self.estimate(request_id)
            if not confidences[i] or limits[i] == 0:
                continue  # nothing offered: the proposer had no drafts, which costs nothing to ask again
            if taken[i] == 0 and estimate.steps_without_drafts + 1 >= PROBE_INTERVAL:
                taken[i] = 1  # probe
            estimate.steps_without_drafts = 0 if taken[i] else estimate.steps_without_drafts + 1
        return taken

    def record(self, request_id: str, proposed: int, accepted: int) -> None:
        """Update the estimate from a verification: drafts 1..accepted were accepted and,
        when accepted < proposed, the next one was rejected (later ones are unobserved)."""
        estimate = self.estimate(request_id)
        observations = [1.0] * accepted + ([0.0] if accepted < proposed else [])
        for x in observations:
            estimate.acceptance = SMOOTHING * estimate.acceptance + (1 - SMOOTHING) * x

    def skip(self, request_id: str) -> None:
        """The request decoded without asking the proposer (its estimate is too low)."""
        self.estimate(request_id).steps_without_drafts += 1

    def remove(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
