"""Runs bench request lists on the engine's ``LLMEngine`` step by step, stamping
each request's first and last token and recording every step's phase timings
(``StepResult.timings``) and the time inside its attention layers."""

from __future__ import annotations

import contextlib
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from engine.bench.metrics import RequestTiming, mean, overhead_share
from engine.bench.roofline import weight_bytes
from engine.bench.step_timer import ModuleTimer
from engine.bench.workloads import ALL_AT_ONCE, SEQUENTIAL, BenchRequest

if TYPE_CHECKING:
    from engine.engine.llm_engine import StepResult
    from engine.runtime.model_builder import WeightMemory

# timed labels: the phases of a step, each the StepTimings field of that name
SCHEDULE = "schedule"  # the scheduler choosing the step's batch, engine overhead
PREPARE = "prepare"  # the runner building input tensors and attention metadata, engine overhead
FORWARD = "forward"  # the model's forward pass
LOGITS = "logits"  # the model's LM head (compute_logits)
SAMPLE = "sample"  # sampling and draft verification, engine overhead
UPDATE = "update"  # the scheduler appending tokens and checking stops (update_from_output), engine overhead
PROCESS = "process"  # the output processor (logprobs, finished requests), engine overhead
PHASE_LABELS = (SCHEDULE, PREPARE, FORWARD, LOGITS, SAMPLE, UPDATE, PROCESS)
MODEL_LABELS = (FORWARD, LOGITS)  # the model's compute
# measured by the bench itself (forward hooks), inside FORWARD
ATTENTION = "attention"  # the engine.layers.attention.Attention modules' forward


@dataclass(frozen=True)
class StepRecord:
    """One ``engine.step()``: its wall time, the seconds of each timed label inside it,
    the token count of its model forward, and how many requests sampled."""

    seconds: float
    timed: dict[str, float]
    forward_tokens: int
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
    """An ``LLMEngine`` built from ``EngineConfig`` settings, plus the attention timer around it."""

    name = "engine"

    def __init__(self, model: str, **settings: Any) -> None:
        """``settings`` are ``EngineConfig`` fields (``dtype``, ``plugins``, ``max_num_seqs``, ...);
        those not given keep EngineConfig's defaults, and EngineConfig rejects unknown names."""
        from engine.config import EngineConfig
        from engine.engine.llm_engine import LLMEngine, freeze_startup_objects

        self.config = EngineConfig(model=model, **settings)
        self.engine = LLMEngine(self.config, progress=False)
        freeze_startup_objects()  # as engine serve does
        self._spec_stats = self.engine.spec.stats if self.engine.spec is not None else None
        self.model = self.engine.runner.model
        self.attention = self._make_attention_timer()
        self._labels = [*PHASE_LABELS, *([ATTENTION] if self.attention is not None else [])]
        self._ids = itertools.count()
        self.last_finish_reasons: dict[str, int] = {}

    def _make_attention_timer(self) -> ModuleTimer | None:
        """A timer of the model's Attention layers, or None for a model without any."""
        from engine.layers.attention import Attention

        layers = [module for module in self.model.modules() if isinstance(module, Attention)]
        return ModuleTimer(layers, self.engine.platform.synchronize) if layers else None

    def timed_labels(self) -> list[str]:
        """The labels a ``StepRecord.timed`` of this runner may hold (``ATTENTION`` only in runs
        with ``time_attention``; kept after :meth:`close`)."""
        return list(self._labels)

    # facts

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    def weight_bytes(self) -> int:
        return weight_bytes(self.model)

    def kv_layers(self) -> list[tuple[int, int | None]]:
        """(bytes a token holds, sliding window or None) of each layer whose cache grows by
        token: what a decode forward reads per token of context (recurrent layers hold a
        state of fixed size instead and are left out)."""
        cache = self.engine.kv_cache
        layers = []
        for tensor, backend in zip(cache.layer_caches, cache.layer_backends):
            per_token = backend.spec.kv_bytes_per_token(tensor.element_size()) if backend is not None else 0
            if per_token:
                layers.append((per_token, backend.spec.sliding_window))
        return layers

    def weight_memory(self) -> WeightMemory:
        """What the model's weights hold, as the engine logged it once they loaded."""
        return self.model.weight_memory

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
            "timed_labels": self.timed_labels(),
            "weights": self.weight_memory().describe(),
        }

    def linear_kernels(self) -> list[str]:
        """What the linear layers' methods say they chose (``LinearMethod.describe``), one line
        per method, e.g. the kernels a platform picked by timing them on this machine."""
        from engine.layers.linear import MergedLinear

        lines, seen = [], set()
        for module in self.model.modules():
            if isinstance(module, MergedLinear) and id(module.method) not in seen:
                seen.add(id(module.method))
                line = module.method.describe()
                line = line and f"{type(module.method).__name__}: {line}"
                if line and line not in lines:  # a quantizer gives every layer a method of its own
                    lines.append(line)
        return lines

    def state_snapshots(self) -> tuple[int, int] | None:
        """Models with recurrent layers and prefix caching: (snapshots held now, bytes each), else None."""
        manager, cache = self.engine.kv_manager, self.engine.kv_cache
        if not manager.num_state_snapshots:
            return None
        row_bytes = sum(
            c[0].numel() * c.element_size()
            for c, backend in zip(cache.layer_caches, cache.layer_backends)
            if backend.spec.is_recurrent
        )
        return len(manager.snapshots), row_bytes

    def spec_stats(self) -> Any:
        """Speculative decoding's counters, or None without it (kept after :meth:`close`)."""
        return self._spec_stats

    # runs

    def reset_prefix_cache(self) -> None:
        """Before a repeated run: its prompts must not hit the cache an earlier run filled."""
        self.engine.reset_prefix_cache()

    def warm_up(self, request: BenchRequest) -> None:
        self.run([request], ALL_AT_ONCE)

    def run(
        self,
        requests: Sequence[BenchRequest],
        submission: str,
        constraints: Sequence[Any] | None = None,
        *,
        time_attention: bool = False,
    ) -> EngineRun:
        """Run ``requests`` submitted ``ALL_AT_ONCE`` or ``SEQUENTIAL`` (each after the
        previous finished). Every request must produce exactly its ``output_len`` tokens;
        with ``constraints`` (a ``StructuredOutputsParams`` per request) at most that many,
        ending when its constraint has ended (its ``RequestTiming.output_len`` is then the
        count it produced). ``time_attention``: each step's record also holds the time inside
        the attention layers (``ATTENTION``), taken by forward hooks that the run carries (a
        hooked module's call costs more, so runs whose walls are compared with peers go without);
        its decode steps run eagerly, since a replayed decode graph calls no hooks."""
        if submission not in (ALL_AT_ONCE, SEQUENTIAL):
            raise ValueError(f"Unknown submission {submission!r}; use {ALL_AT_ONCE!r} or {SEQUENTIAL!r}.")
        timings: list[RequestTiming] = []
        steps: list[StepRecord] = []
        runner = self.engine.runner
        unsynchronized = runner.synchronize
        runner.synchronize = self.engine.platform.synchronize  # each phase clock waits for the device
        timer = self.attention if time_attention else None
        graphs = runner.graphs if timer is not None else None
        if graphs is not None:
            graphs.paused = True
        try:
            with timer or contextlib.nullcontext():
                start = time.perf_counter()
                if submission == ALL_AT_ONCE:
                    timings = self._drive(requests, steps, constraints, timer)
                else:
                    for i, request in enumerate(requests):
                        timings.extend(self._drive([request], steps, constraints and constraints[i : i + 1], timer))
                wall = time.perf_counter() - start
        finally:
            runner.synchronize = unsynchronized
            if graphs is not None:
                graphs.paused = False
        return EngineRun(timings, wall, steps)

    def _record(self, seconds: float, result: StepResult, timer: ModuleTimer | None) -> StepRecord:
        """The StepRecord of one step from its ``StepResult`` (and the attention ``timer``, when
        the run carries it)."""
        timings = result.timings
        timed = {label: getattr(timings, label) for label in PHASE_LABELS}
        if timer is not None:
            timed[ATTENTION] = timer.take()
        all_decode = (
            bool(result.updated)
            and timings.forward_tokens == len(result.updated)
            and all(r.num_output_tokens >= 2 for r in result.updated)
        )
        return StepRecord(seconds, timed, timings.forward_tokens, len(result.updated), all_decode)

    def _drive(
        self,
        requests: Sequence[BenchRequest],
        steps: list[StepRecord],
        constraints: Sequence[Any] | None,
        timer: ModuleTimer | None,
    ) -> list[RequestTiming]:
        from engine.sampling_params import SamplingParams

        submitted = time.perf_counter()
        index: dict[str, int] = {}
        produced = [r.output_len for r in requests]
        reasons = self.last_finish_reasons = {}  # finish reason -> requests
        for i, r in enumerate(requests):
            constraint = constraints[i] if constraints is not None else None
            params = SamplingParams(
                temperature=0.0, max_tokens=r.output_len, ignore_eos=True, structured_outputs=constraint
            )
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
                steps.append(self._record(end - start, result, timer))
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
                    produced[i] = request.num_output_tokens
                    reasons[request.status.value] = reasons.get(request.status.value, 0) + 1
                    if constraints is not None:
                        if request.status.value not in ("stop", "length"):
                            raise RuntimeError(f"Request {i} ended with {request.status.value}.")
                    elif request.num_output_tokens != requests[i].output_len:
                        raise RuntimeError(
                            f"Request {i} produced {request.num_output_tokens} tokens, the workload asks for "
                            f"exactly {requests[i].output_len} (finish: {request.status.value})."
                        )
        except BaseException:
            for request_id in pending:
                self.engine.abort(request_id)
            raise
        return [
            RequestTiming(submitted, first[i], finished[i], r.prompt_len, produced[i])  # type: ignore[arg-type]
            for i, r in enumerate(requests)
        ]

    def precompile(self, constraints: Sequence[Any]) -> list[float]:
        """Compile each constraint (as the server does before a request reaches the engine
        loop); the seconds each took."""
        seconds = []
        for constraint in constraints:
            start = time.perf_counter()
            self.engine.structured_output.compile(constraint)
            seconds.append(time.perf_counter() - start)
        return seconds

    def close(self) -> None:
        """Drop the engine (and its KV cache) before peers run in the same process."""
        self.engine = None  # type: ignore[assignment]
        self.model = None
        self.attention = None  # it holds the model's attention layers


@dataclass(frozen=True)
class DecodeBreakdown:
    """Means over the steps that decoded exactly ``num_seqs`` sequences and nothing else."""

    num_seqs: int
    num_steps: int
    step_seconds: float
    model_seconds: float  # the forward and logits phases
    parts: dict[str, float]  # other timed labels (logits, attention inside the model; schedule, prepare, ... outside)

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
    # ATTENTION only from runs that timed it (time_attention)
    timed_attention = all(ATTENTION in s.timed for s in chosen)
    parts = {
        label: mean([s.timed.get(label, 0.0) for s in chosen])
        for label in labels
        if label != FORWARD and (label != ATTENTION or timed_attention)
    }
    return DecodeBreakdown(
        num_seqs, len(chosen), mean([s.seconds for s in chosen]), mean([s.model_seconds for s in chosen]), parts
    )
