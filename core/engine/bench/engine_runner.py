"""Runs bench request lists on the engine's ``LLMEngine`` step by step, stamping
each request's first and last token and timing the model inside every step."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from engine.bench.metrics import RequestTiming, mean, overhead_share
from engine.bench.roofline import weight_bytes
from engine.bench.step_timer import CallTimer
from engine.bench.workloads import ALL_AT_ONCE, SEQUENTIAL, BenchRequest

# labels of the timed calls
FORWARD = "forward"  # model.forward
LOGITS = "logits"  # model.compute_logits (the LM head)
MODEL_LABELS = (FORWARD, LOGITS)  # the model's compute
ATTENTION = "attention"  # the attention layers, inside FORWARD
SCHEDULE = "schedule"  # scheduler.schedule, engine overhead
PREPARE = "prepare"  # runner.prepare_arrays + to_device (input tensors, metadata), engine overhead


@dataclass(frozen=True)
class StepRecord:
    """One ``engine.step()``: its wall time, the time of each timed label inside it,
    the token count of each model forward, and how many requests sampled."""

    seconds: float
    timed: dict[str, float]
    forward_tokens: list[int]
    num_sampled: int
    all_decode: bool  # one forward, one token per sampling request, each past its first token

    @property
    def model_seconds(self) -> float:
        return sum(self.timed.get(label, 0.0) for label in MODEL_LABELS)

    def is_decode_of(self, num_seqs: int) -> bool:
        return self.all_decode and self.num_sampled == num_seqs


@dataclass
class EngineRun:
    timings: list[RequestTiming]
    wall: float
    steps: list[StepRecord] = field(default_factory=list)


class EngineRunner:
    """An ``LLMEngine`` built from bench options, plus the timers around it."""

    name = "engine"

    def __init__(
        self, model: str, *, plugins: str | None, dtype: str, max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None, quantization: str | None = None,
        quantization_config: str | None = None, speculative_method: str | None = None,
        num_speculative_tokens: int = 4, speculative_config: str | None = None,
    ) -> None:
        from engine.config import EngineConfig
        from engine.engine.llm_engine import LLMEngine

        limits = {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens}
        self.config = EngineConfig(
            model=model, plugins=plugins, dtype=dtype, quantization=quantization,
            quantization_config=quantization_config, speculative_method=speculative_method,
            num_speculative_tokens=num_speculative_tokens, speculative_config=speculative_config,
            **{k: v for k, v in limits.items() if v is not None},
        )
        self.engine = LLMEngine(self.config, progress=False)
        self._spec_stats = self.engine.spec.stats if self.engine.spec is not None else None
        self.model = self._model_called_by_runner()
        self.timer = self._make_timer()
        self._ids = itertools.count()

    def _model_called_by_runner(self) -> Any:
        runner = getattr(self.engine, "runner", None)
        model = getattr(runner, "model", None) or getattr(self.engine, "model", None)
        if model is None:
            raise RuntimeError(
                "engine bench times the model through LLMEngine.runner.model or LLMEngine.model; "
                "this engine has neither. Update engine/bench/engine_runner.py to the new layout."
            )
        return model

    def _make_timer(self) -> CallTimer:
        from engine.layers.attention import Attention

        timer = CallTimer(self.engine.platform.synchronize)
        timer.add(self.model, "forward", FORWARD, count_tokens=True)
        timer.add(self.model, "compute_logits", LOGITS)
        # best effort: the breakdown rows disappear if these move
        for module in self.model.modules():
            if isinstance(module, Attention):
                timer.add(module, "forward", ATTENTION)
        if callable(getattr(self.engine.scheduler, "schedule", None)):
            timer.add(self.engine.scheduler, "schedule", SCHEDULE)
        for method in ("prepare_arrays", "to_device"):
            if callable(getattr(self.engine.runner, method, None)):
                timer.add(self.engine.runner, method, PREPARE)
        return timer

    # facts

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    def weight_bytes(self) -> int:
        return weight_bytes(self.model)

    def describe(self) -> dict[str, Any]:
        return {
            "architecture": self.engine.architecture,
            "platform": self.engine.platform.name,
            "dtype": self.engine.dtype_name,
            "quantization": self.engine.quantizer.name if self.engine.quantizer is not None else None,
            "speculative": self.engine.spec.proposer.name if self.engine.spec is not None else None,
            "max_num_seqs": self.config.max_num_seqs,
            "max_num_batched_tokens": self.config.max_num_batched_tokens,
            "kv_cache_blocks": self.engine.kv_cache.num_blocks,
            "block_size": self.config.block_size,
            "timed_labels": self.timer.labels(),
        }

    def spec_stats(self) -> Any:
        """Speculative decoding's counters, or None without it (kept after :meth:`close`)."""
        return self._spec_stats

    # runs

    def reset_prefix_cache(self) -> None:
        """Before a repeated run: its prompts must not hit the cache an earlier run filled."""
        self.engine.reset_prefix_cache()

    def warm_up(self, request: BenchRequest) -> None:
        self.run([request], ALL_AT_ONCE)

    def run(self, requests: Sequence[BenchRequest], submission: str) -> EngineRun:
        """Run ``requests`` submitted ``ALL_AT_ONCE`` or ``SEQUENTIAL`` (each after the
        previous finished). Every request must produce exactly its ``output_len`` tokens."""
        if submission not in (ALL_AT_ONCE, SEQUENTIAL):
            raise ValueError(f"Unknown submission {submission!r}; use {ALL_AT_ONCE!r} or {SEQUENTIAL!r}.")
        timings: list[RequestTiming] = []
        steps: list[StepRecord] = []
        with self.timer:
            self.timer.take()
            start = time.perf_counter()
            if submission == ALL_AT_ONCE:
                timings = self._drive(requests, steps)
            else:
                for request in requests:
                    timings.extend(self._drive([request], steps))
            wall = time.perf_counter() - start
        return EngineRun(timings, wall, steps)

    def _drive(self, requests: Sequence[BenchRequest], steps: list[StepRecord]) -> list[RequestTiming]:
        from engine.sampling_params import SamplingParams

        submitted = time.perf_counter()
        index: dict[str, int] = {}
        for i, r in enumerate(requests):
            params = SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
            request = self.engine.add_request(f"bench-{next(self._ids)}", list(r.prompt_token_ids), params)
            index[request.request_id] = i
        first: list[float | None] = [None] * len(requests)
        finished: list[float | None] = [None] * len(requests)
        pending = set(index)
        try:
            while pending:
                start = time.perf_counter()
                result = self.engine.step()
                end = time.perf_counter()
                timed, tokens = self.timer.take()
                forward_tokens = tokens.get(FORWARD, [])
                all_decode = (
                    len(forward_tokens) == 1
                    and forward_tokens[0] == len(result.updated)
                    and all(r.num_output_tokens >= 2 for r in result.updated)
                )
                steps.append(StepRecord(end - start, timed, forward_tokens, len(result.updated), all_decode))
                for request in result.updated:
                    i = index.get(request.request_id)
                    if i is not None and first[i] is None:
                        first[i] = end
                for request in result.finished:
                    i = index.get(request.request_id)
                    if i is None:
                        continue
                    finished[i] = end
                    pending.discard(request.request_id)
                    if request.num_output_tokens != requests[i].output_len:
                        raise RuntimeError(
                            f"Request {i} produced {request.num_output_tokens} tokens, the workload asks for "
                            f"exactly {requests[i].output_len} (finish: {request.status.value})."
                        )
        except BaseException:
            for request_id in pending:
                self.engine.abort(request_id)
            raise
        return [
            RequestTiming(submitted, first[i], finished[i], r.prompt_len, r.output_len)  # type: ignore[arg-type]
            for i, r in enumerate(requests)
        ]

    def close(self) -> None:
        """Drop the engine (and its KV cache) before peers run in the same process."""
        self.engine = None  # type: ignore[assignment]
        self.model = None
        self.timer = None  # type: ignore[assignment]


@dataclass(frozen=True)
class DecodeBreakdown:
    """Means over the steps that decoded exactly ``num_seqs`` sequences and nothing else."""

    num_seqs: int
    num_steps: int
    step_seconds: float
    model_seconds: float  # model.forward + model.compute_logits
    parts: dict[str, float]  # other timed labels (logits, attention inside the model; schedule, prepare outside)

    @property
    def overhead_seconds(self) -> float:
        return self.step_seconds - self.model_seconds

    @property
    def overhead_share(self) -> float:
        return overhead_share(self.step_seconds, self.model_seconds)


def decode_breakdown(steps: Sequence[StepRecord], num_seqs: int, labels: Sequence[str]) -> DecodeBreakdown | None:
    """Mean step, model and per-label times over the all-decode steps of ``num_seqs``
    sequences; None when there were none."""
    chosen = [s for s in steps if s.is_decode_of(num_seqs)]
    if not chosen:
        return None
    parts = {label: mean([s.timed.get(label, 0.0) for s in chosen]) for label in labels if label != FORWARD}
    return DecodeBreakdown(
        num_seqs, len(chosen), mean([s.seconds for s in chosen]), mean([s.model_seconds for s in chosen]), parts
    )
