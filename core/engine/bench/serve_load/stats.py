"""The arithmetic of ``engine bench serve``'s figures, apart from any timing, so that it can
be checked on hand-made records: percentiles, per-request TPOT, and each latency's summary."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between the closest ranks,
    as ``numpy.percentile``'s default: rank ``q / 100 * (n - 1)`` in the sorted values."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"a percentile is between 0 and 100, got {q}.")
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass
class RequestRecord:
    """One request as the client saw it. Times are seconds: ``start`` after the run began
    (when it was sent), ``ttft`` and ``e2e`` after ``start`` (a failed request's ``e2e``:
    until it failed); ``itl`` the gaps between successive content chunks."""

    index: int
    prompt_len: int | None  # the target, when the dataset gave one
    output_len: int  # asked for
    start: float = 0.0
    scheduled: float = 0.0  # its arrival time; it waits for a free slot under --max-concurrency
    success: bool = False
    error: str | None = None
    status: int | None = None
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    num_chunks: int = 0  # content chunks in the stream
    prompt_tokens: int | None = None  # usage.prompt_tokens
    completion_tokens: int | None = None  # usage.completion_tokens

    @property
    def output_tokens(self) -> int:
        """The server's usage when it gave one, else the content chunks counted."""
        return self.completion_tokens if self.completion_tokens is not None else self.num_chunks

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (output tokens - 1)."""
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def as_dict(self) -> dict:
        return {
            "index": self.index,
            "success": self.success,
            "error": self.error,
            "status": self.status,
            "scheduled_s": self.scheduled,
            "start_s": self.start,
            "target_prompt_len": self.prompt_len,
            "requested_output_len": self.output_len,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "usage_completion_tokens": self.completion_tokens,
            "content_chunks": self.num_chunks,
            "ttft_ms": None if self.ttft is None else self.ttft * 1e3,
            "tpot_ms": None if self.tpot is None else self.tpot * 1e3,
            "e2e_ms": None if self.e2e is None else self.e2e * 1e3,
            "itl_ms": [gap * 1e3 for gap in self.itl],
        }


@dataclass(frozen=True)
class Summary:
    """mean, median and the chosen percentiles of one latency, in ms; None without values."""

    count: int
    mean: float | None
    median: float | None
    percentiles: dict[float, float | None]

    @classmethod
    def of(cls, seconds: Sequence[float], qs: Sequence[float]) -> "Summary":
        ms = [s * 1e3 for s in seconds]
        if not ms:
            return cls(0, None, None, {q: None for q in qs})
        return cls(len(ms), sum(ms) / len(ms), percentile(ms, 50), {q: percentile(ms, q) for q in qs})

    def as_dict(self) -> dict:
        return {
            "count": self.count,
            "mean": self.mean,
            "median": self.median,
            **{f"p{q:g}": value for q, value in self.percentiles.items()},
        }


def latency_summaries(records: Sequence[RequestRecord], qs: Sequence[float]) -> dict[str, Summary]:
    """TTFT, TPOT, ITL (every gap of every request, pooled) and E2E over the successful requests."""
    done = [r for r in records if r.success]
    return {
        "ttft": Summary.of([r.ttft for r in done if r.ttft is not None], qs),
        "tpot": Summary.of([r.tpot for r in done if r.tpot is not None], qs),
        "itl": Summary.of([gap for r in done for gap in r.itl], qs),
        "e2e": Summary.of([r.e2e for r in done if r.e2e is not None], qs),
    }
