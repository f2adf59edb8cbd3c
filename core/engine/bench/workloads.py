"""The request lists of benchmarks/README.md, as pure functions of (vocab size, scale).

At ``scale=1`` every list is exactly the workload benchmarks/README.md defines.
Token ids are drawn from ``random.Random(seed)`` in ``[0, max_token_id(vocab_size)]``,
which is ``[0, 31999]`` for ``llama58m`` (vocab 32000); smaller vocabularies
(the tiny test checkpoints) get a lower bound so that every id is valid.

Seeds: W2 uses ``Random(0)``, as its definition prescribes. The definitions leave the
ids of the other lists open; each has its own seed so that no two lists (and
the warm-up request) share a prefix by accident: W1 ``Random(1)``, W3
``Random(3)``, the 64-sequence decode list ``Random(5)``, warm-up ``Random(7)``, the
repetition list ``Random(9)``.

``scale`` shrinks every count and length (rounded, at least 1; output lengths
that a decode rate needs at least 2). Anything but 1 is a smoke test, not a
comparable figure.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

MAX_TOKEN_ID = 31999

W1_SEED = 1
W2_SEED = 0
W3_SEED = 3
DECODE_SEED = 5
WARMUP_SEED = 7
REPEAT_SEED = 9

ALL_AT_ONCE = "all at once"
SEQUENTIAL = "one after another"


@dataclass(frozen=True)
class BenchRequest:
    """One request: prompt token ids, and exactly ``output_len`` tokens to generate (EOS ignored)."""

    prompt_token_ids: tuple[int, ...]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class Workload:
    """A request list and how it is submitted (``ALL_AT_ONCE`` or ``SEQUENTIAL``)."""

    name: str
    requests: tuple[BenchRequest, ...]
    submission: str
    description: str

    @property
    def num_prompt_tokens(self) -> int:
        return sum(r.prompt_len for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)


def max_token_id(vocab_size: int) -> int:
    """Largest prompt token id drawn: 31999, or ``vocab_size - 1`` when the vocabulary is smaller."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}.")
    return min(MAX_TOKEN_ID, vocab_size - 1)


def scaled(n: int, scale: float, minimum: int = 1) -> int:
    """``n`` times ``scale``, rounded, at least ``minimum``; ``n`` itself at scale 1."""
    if scale <= 0:
        raise ValueError(f"scale must be positive, got {scale}.")
    return max(minimum, round(n * scale))


def _ids(rng: random.Random, n: int, high: int) -> tuple[int, ...]:
    return tuple(rng.randint(0, high) for _ in range(n))


def latency_workload(vocab_size: int = 32000, *, scale: float = 1.0) -> Workload:
    """W1: 1 request, prompt 128 tokens, 128 output tokens."""
    prompt_len, output_len = scaled(128, scale), scaled(128, scale, minimum=2)
    rng = random.Random(W1_SEED)
    request = BenchRequest(_ids(rng, prompt_len, max_token_id(vocab_size)), output_len)
    return Workload("W1 latency", (request,), SEQUENTIAL, f"1 request, prompt {prompt_len}, {output_len} output tokens")


def repetition_workload(vocab_size: int = 32000, *, scale: float = 1.0) -> Workload:
    """Speculative decoding's workload: 4 requests one after another, each prompt a phrase of
    32 random ids said 4 times (128 tokens), 128 output tokens. A model that has learnt to
    continue a repeated sequence keeps repeating it, which the n-gram proposer can draft."""
    num_requests, phrase_len = scaled(4, scale), scaled(32, scale)
    output_len = scaled(128, scale, minimum=2)
    rng = random.Random(REPEAT_SEED)
    high = max_token_id(vocab_size)
    requests = tuple(BenchRequest(_ids(rng, phrase_len, high) * 4, output_len) for _ in range(num_requests))
    return Workload(
        "Repetition",
        requests,
        SEQUENTIAL,
        f"{num_requests} requests, each a {phrase_len}-token phrase said 4 times, {output_len} output tokens, "
        f"each submitted after the previous finished",
    )


def throughput_workload(vocab_size: int = 32000, *, scale: float = 1.0) -> Workload:
    """W2: 64 requests from ``Random(0)``: all (prompt_len randint(32, 512), output_len
    randint(16, 256)) pairs first, then each request's prompt ids randint(0, 31999)."""
    num_requests = scaled(64, scale)
    prompt_range = scaled(32, scale), scaled(512, scale)
    output_range = scaled(16, scale), scaled(256, scale)
    rng = random.Random(W2_SEED)
    lengths = [(rng.randint(*prompt_range), rng.randint(*output_range)) for _ in range(num_requests)]
    high = max_token_id(vocab_size)
    requests = tuple(BenchRequest(_ids(rng, prompt_len, high), output_len) for prompt_len, output_len in lengths)
    return Workload(
        "W2 throughput",
        requests,
        ALL_AT_ONCE,
        f"{num_requests} requests, prompt {prompt_range[0]}..{prompt_range[1]}, "
        f"output {output_range[0]}..{output_range[1]} tokens, submitted at once",
    )


def prefix_workload(vocab_size: int = 32000, *, scale: float = 1.0) -> Workload:
    """W3: 32 requests sharing a 1024-token prefix, each with its own 64-token suffix
    (redrawn on the unlikely repeat so that all suffixes differ), 64 output tokens."""
    num_requests, prefix_len = scaled(32, scale), scaled(1024, scale)
    suffix_len, output_len = scaled(64, scale), scaled(64, scale, minimum=2)
    rng = random.Random(W3_SEED)
    high = max_token_id(vocab_size)
    prefix = _ids(rng, prefix_len, high)
    suffixes: list[tuple[int, ...]] = []
    while len(suffixes) < num_requests:
        suffix = _ids(rng, suffix_len, high)
        if suffix not in suffixes:
            suffixes.append(suffix)
    requests = tuple(BenchRequest(prefix + suffix, output_len) for suffix in suffixes)
    return Workload(
        "W3 shared prefix",
        requests,
        SEQUENTIAL,
        f"{num_requests} requests, shared prefix {prefix_len} + own suffix {suffix_len}, "
        f"{output_len} output tokens, each submitted after the previous finished",
    )


def decode_workload(vocab_size: int = 32000, *, scale: float = 1.0) -> Workload:
    """The engine-overhead list: 64 requests, prompt 32, 64 output tokens, submitted at
    once, so that after the first step every step decodes all 64 sequences."""
    num_requests, prompt_len, output_len = scaled(64, scale), scaled(32, scale), scaled(64, scale, minimum=2)
    rng = random.Random(DECODE_SEED)
    high = max_token_id(vocab_size)
    requests = tuple(BenchRequest(_ids(rng, prompt_len, high), output_len) for _ in range(num_requests))
    return Workload(
        "decode overhead",
        requests,
        ALL_AT_ONCE,
        f"{num_requests} requests, prompt {prompt_len}, {output_len} output tokens, submitted at once",
    )


def warmup_request(vocab_size: int = 32000) -> BenchRequest:
    """The tiny untimed request run first, so that one-time costs stay out of the figures."""
    return BenchRequest(_ids(random.Random(WARMUP_SEED), 8, max_token_id(vocab_size)), 4)
