"""The arithmetic behind every figure, kept apart from timing so that it can be
checked on hand-computed inputs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class RequestTiming:
    """``time.perf_counter()`` stamps of one request: submitted, first output token
    available, last output token available."""

    submitted: float
    first_token: float
    finished: float
    prompt_len: int
    output_len: int

    @property
    def ttft(self) -> float:
        return self.first_token - self.submitted

    @property
    def decode_seconds(self) -> float:
        """Time spent producing every token after the first."""
        return self.finished - self.first_token


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``; None when either is missing or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def mean(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("mean of no values")
    return sum(values) / len(values)


def tokens_per_s(num_tokens: int, seconds: float) -> float:
    if seconds <= 0:
        raise ValueError(f"{num_tokens} tokens in {seconds} s: the time must be positive.")
    return num_tokens / seconds


def decode_tokens_per_s(timing: RequestTiming) -> float:
    """Tokens after the first over the time after the first: (N - 1) / (t_N - t_1)."""
    if timing.output_len < 2:
        raise ValueError(f"A decode rate needs at least 2 output tokens, the request has {timing.output_len}.")
    return tokens_per_s(timing.output_len - 1, timing.decode_seconds)


def decode_step_seconds(timing: RequestTiming) -> float:
    """Mean time per decode step of a single request: (t_N - t_1) / (N - 1)."""
    return 1.0 / decode_tokens_per_s(timing)


def overhead_share(step_seconds: float, model_seconds: float) -> float:
    """Share of a step spent outside the model: (step - model) / step."""
    if step_seconds <= 0:
        raise ValueError(f"step time must be positive, got {step_seconds}.")
    return (step_seconds - model_seconds) / step_seconds


def bandwidth_gb_per_s(num_bytes: int, seconds: float) -> float:
    """Bytes read per second, in GB/s (10^9)."""
    if seconds <= 0:
        raise ValueError(f"time must be positive, got {seconds}.")
    return num_bytes / seconds / 1e9


def decode_kv_read_bytes(lengths: Sequence[tuple[int, int]], layers: Sequence[tuple[int, int | None]]) -> int:
    """Bytes of KV cache that the decode forwards of requests with (prompt, output) ``lengths``
    read, none of it shared: output token j >= 1 of a request comes from a forward of token
    j - 1 that attends over prompt + j positions, in each layer of ``layers`` ((bytes a token
    holds there, sliding window or None)) the last ``window`` of them. Token 0 comes from the
    prefill."""
    total = 0
    for prompt, output in lengths:
        if prompt < 1:
            raise ValueError(f"a request needs a prompt, got {prompt} tokens")
        for per_token, window in layers:
            for context in range(prompt + 1, prompt + output):
                total += per_token * (context if window is None else min(context, window))
    return total


def weight_read_seconds(num_bytes: int, gb_per_s: float) -> float:
    """Time to read ``num_bytes`` once at ``gb_per_s``."""
    if gb_per_s <= 0:
        raise ValueError(f"bandwidth must be positive, got {gb_per_s}.")
    return num_bytes / (gb_per_s * 1e9)


@dataclass(frozen=True)
class PrefixFigures:
    first_ttft: float
    rest_mean_ttft: float
    rest_over_first: float


def prefix_figures(timings: Sequence[RequestTiming]) -> PrefixFigures:
    """W3: TTFT of request 1, mean TTFT of requests 2..N, and their ratio (below 1:
    later requests start faster, as they should when the shared prefix is cached)."""
    if len(timings) < 2:
        raise ValueError(f"W3 needs at least 2 requests, got {len(timings)}.")
    first = timings[0].ttft
    rest = mean([t.ttft for t in timings[1:]])
    return PrefixFigures(first, rest, rest / first)
