"""An engine's structured-output backend: built on first use, its compiled constraints
cached by key, compiles run off the step loop and bounded in time and size."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from engine.interfaces.structured_output import (
    ConstraintError,
    GrammarMatcher,
    StructuredOutputBackend,
    StructuredOutputInit,
)
from engine.sampling_params import StructuredOutputsParams

logger = logging.getLogger("engine")

CACHE_SIZE = 512  # compiled constraints kept (least recently used first out)
# a constraint whose first token mask takes longer is refused: its masks would hold up every step
MASK_PROBE_SECONDS = 0.05
MASK_PROBE_TRIES = 3  # fills timed before a constraint is called slow to mask


class StructuredOutputManager:
    """Compiles constraints with the engine's backend and makes each request's matcher.

    :meth:`compile` may be called from any thread (the server compiles before it hands a
    request to the engine loop, so that the loop never waits on a compile). Each compile
    runs on a thread of its own; a caller waits at most ``compile_timeout`` seconds, then
    gets a :class:`ConstraintError` (the compile goes on and its result is cached: a
    backend call cannot be interrupted).
    """

    def __init__(
        self,
        backend_cls: type[StructuredOutputBackend] | None,
        *,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        config: dict,
        compile_timeout: float,
        max_constraint_chars: int,
        max_rollback: int,
        disable_any_whitespace: bool = False,
    ) -> None:
        self.backend_cls = backend_cls
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(sorted(eos_token_ids))
        self.config = dict(config)
        self.compile_timeout = compile_timeout
        self.max_constraint_chars = max_constraint_chars
        self.max_rollback = max_rollback
        self.disable_any_whitespace = disable_any_whitespace
        self._backend: StructuredOutputBackend | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._pending: dict[str, Future] = {}
        # compiles done, and the seconds they took (for engine bench and metrics)
        self.num_compiles = 0
        self.compile_seconds = 0.0

    @property
    def backend(self) -> StructuredOutputBackend:
        if self._backend is None:
            with self._lock:
                if self._backend is None:
                    self._backend = self._build()
        return self._backend

    def _build(self) -> StructuredOutputBackend:
        if self.backend_cls is None:
            raise ConstraintError(
                "Structured output needs a structured-output backend and none is installed: "
                "pip install engine-xgrammar (or engine-llguidance)."
            )
        if self.tokenizer is None:
            raise ConstraintError("Structured output needs the model's tokenizer, and this model has none.")
        started = time.perf_counter()
        backend = self.backend_cls(
            StructuredOutputInit(
                tokenizer=self.tokenizer,
                vocab_size=self.vocab_size,
                eos_token_ids=self.eos_token_ids,
                config=self.config,
                max_threads=int(self.config.get("max_threads", 2)),
            )
        )
        logger.info(
            "structured output: backend %s ready in %.2f s", self.backend_cls.name, time.perf_counter() - started
        )
        return backend

    def check(self, constraint: StructuredOutputsParams) -> None:
        """Refuse what no compile is tried for: a constraint over the size bound, or of a kind
        the backend does not compile."""
        if constraint.size > self.max_constraint_chars:
            raise ConstraintError(
                f"The {constraint.kind} constraint has {constraint.size} characters; this server compiles "
                f"at most {self.max_constraint_chars} (--structured-output-max-constraint-chars)."
            )
        backend = self.backend
        if constraint.kind not in backend.supported_kinds:
            raise ConstraintError(
                f"The structured-output backend {backend.name!r} does not support {constraint.kind} constraints "
                f"(it supports {', '.join(sorted(backend.supported_kinds))})."
            )

    def compile(self, constraint: StructuredOutputsParams) -> Any:
        """The compiled constraint, from the cache or compiled now (waiting at most the
        timeout). Raises :class:`ConstraintError` for a constraint the backend refuses."""
        constraint = self.effective(constraint)
        try:
            key = constraint.key
        except RecursionError:
            raise ConstraintError(f"The {constraint.kind} constraint is nested too deeply.") from None
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        self.check(constraint)
        with self._lock:
            if key in self._cache:
                return self._cache[key]
            future = self._pending.get(key)
            if future is None:
                future = self._pending[key] = Future()
                threading.Thread(
                    target=self._run_compile, args=(constraint, future), name="engine-compile", daemon=True
                ).start()
        try:
            return future.result(timeout=self.compile_timeout)
        except FutureTimeout:
            raise ConstraintError(
                f"The {constraint.kind} constraint did not compile within {self.compile_timeout:g} s "
                f"(--structured-output-compile-timeout); simplify it."
            ) from None

    def _run_compile(self, constraint: StructuredOutputsParams, future: Future) -> None:
        key = constraint.key
        started = time.perf_counter()
        try:
            compiled = self.backend.compile(constraint)
            self._probe(constraint, compiled)
        except ConstraintError as exc:
            outcome: Any = exc
        except Exception as exc:  # a backend's own error type: still the constraint's fault, as a 400
            outcome = ConstraintError(f"The {constraint.kind} constraint cannot be compiled: {exc}")
        else:
            outcome = None
        seconds = time.perf_counter() - started
        with self._lock:
            self._pending.pop(key, None)
            if outcome is None:
                self._cache[key] = compiled
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
                self.num_compiles += 1
                self.compile_seconds += seconds
        if outcome is None:
            future.set_result(compiled)
        else:
            future.set_exception(outcome)

    def _probe(self, constraint: StructuredOutputsParams, compiled: Any) -> None:
        """Fill the constraint's first mask once: one that is slow to fill (a regex of nested
        counted repeats, for some backends) would slow every step of every request."""
        import torch

        from engine.interfaces.structured_output import bitmask_width

        bitmask = torch.zeros(1, bitmask_width(self.vocab_size), dtype=torch.int32)
        seconds = float("inf")
        # the fastest of a few fills, on fresh matchers: a busy machine (or a first fill's one-time
        # setup) can stretch one, while a constraint slow to mask is slow every time
        for _ in range(MASK_PROBE_TRIES):
            matcher = self.backend.matcher(compiled, 0)
            started = time.perf_counter()
            matcher.fill_bitmask(bitmask, 0)
            seconds = min(seconds, time.perf_counter() - started)
            if seconds <= MASK_PROBE_SECONDS:
                break
        if seconds > MASK_PROBE_SECONDS:
            raise ConstraintError(
                f"The {constraint.kind} constraint takes {seconds * 1e3:.0f} ms to compute one token's mask with "
                f"the {self.backend.name} backend (at most {MASK_PROBE_SECONDS * 1e3:.0f} ms): it would slow every "
                "request; simplify it (nested counted repeats such as (x{0,1000}){0,1000} are the usual cause)."
            )
        if not bitmask.any():
            raise ConstraintError(f"The {constraint.kind} constraint allows no output at all.")

    def effective(self, constraint: StructuredOutputsParams) -> StructuredOutputsParams:
        """The constraint as compiled: the engine's whitespace setting applied."""
        if self.disable_any_whitespace and not constraint.disable_any_whitespace:
            return dataclasses.replace(constraint, disable_any_whitespace=True)
        return constraint

    def matcher(self, constraint: StructuredOutputsParams) -> GrammarMatcher:
        """A new request's matcher, at the start of its constraint."""
        return self.backend.matcher(self.compile(constraint), self.max_rollback)

    def close(self) -> None:
        if self._backend is not None:
            self._backend.close()
