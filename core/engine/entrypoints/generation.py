"""What every endpoint does between a validated body and its response format:
turn prompts into token ids, check them against the model's limits, build
``SamplingParams``, run one or more prompts through the ``AsyncEngine``, and
time each sample for the metrics.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from engine.entrypoints.async_engine import AsyncEngine, RequestStream, SampleDelta
from engine.entrypoints.errors import bad_request
from engine.entrypoints.metrics import ServerMetrics
from engine.sampling_params import SamplingParams

logger = logging.getLogger("engine.server")

PRIORITY_HEADER = "x-request-priority"


def new_request_id(prefix: str, separator: str = "-") -> str:
    return f"{prefix}{separator}{uuid.uuid4().hex[:24]}"


def check_text(text: str, param: str) -> str:
    if "\x00" in text:
        raise bad_request(f"{param} contains a NUL character (\\u0000), which is not allowed.", param=param)
    return text


def parse_priority(headers: Any) -> int:
    raw = headers.get(PRIORITY_HEADER)
    if raw is None:
        return 0
    try:
        return int(raw.strip())
    except ValueError:
        raise bad_request(
            f"The X-Request-Priority header must be an integer (lower runs first), got {raw!r}.",
            param="X-Request-Priority",
        ) from None


@dataclass
class SampleTiming:
    """Arrival, first token and the gaps between tokens of one sample."""

    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    gaps: list[float] = field(default_factory=list)

    def mark(self, now: float, num_new_tokens: int) -> None:
        if num_new_tokens <= 0:
            return
        if self.first_token is None:
            self.first_token = now
        elif self.last_token is not None:
            self.gaps.append(now - self.last_token)
        self.last_token = now


@dataclass
class PromptInput:
    token_ids: list[int]
    text: str | None = None


class Generation:
    """One HTTP request's worth of prompts, each with ``n`` samples, on the engine.

    ``choice index = prompt position * n + sample index`` (the OpenAI rule for
    batched prompts).
    """

    def __init__(
        self,
        engine: AsyncEngine,
        metrics: ServerMetrics,
        endpoint: str,
        request_id: str,
        prompts: list[PromptInput],
        params: SamplingParams,
        priority: int,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.endpoint = endpoint
        self.request_id = request_id
        self.prompts = prompts
        self.params = params
        self.priority = priority
        self.arrival = time.monotonic()
        self.timings = {i: SampleTiming(self.arrival) for i in range(len(prompts) * params.n)}
        self.output_tokens = {i: 0 for i in self.timings}
        self.reasoning_tokens = {i: 0 for i in self.timings}
        self.finish_reasons: dict[int, str] = {}
        self.constraint_param: str | None = None  # the body field its output constraint came from
        self.score_only = False  # echo with max_tokens 0: the prompt's logprobs are the answer
        self._streams: list[RequestStream] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_tokens.values())

    @property
    def num_reasoning_tokens(self) -> int:
        return sum(self.reasoning_tokens.values())

    async def start(self) -> None:
        """Add every prompt to the engine. A refused prompt (``ValueError``) aborts the
        ones added before it and propagates, before any response has begun."""
        if self._streams is not None:
            return
        streams: list[RequestStream] = []
        try:
            for position, p in enumerate(self.prompts):
                streams.append(
                    await self.engine.add(
                        self._engine_id(position),
                        p.token_ids,
                        self.params,
                        priority=self.priority,
                        prompt=p.text,
                        group=self.request_id,  # one HTTP request's prompts and samples share their seats
                    )
                )
        except BaseException:
            for stream in streams:
                stream.close()
            raise
        self._streams = streams

    def close(self) -> None:
        """Abort whatever still runs (idempotent)."""
        for stream in self._streams or []:
            stream.close()

    async def deltas(self) -> AsyncIterator[tuple[int, SampleDelta]]:
        """``(choice index, delta)`` as they come, across all prompts. Leaving the
        iteration early aborts whatever still runs."""
        await self.start()
        n = self.params.n
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(position: int, stream: RequestStream) -> None:
            try:
                async for delta in stream:
                    queue.put_nowait((position, delta))
            except BaseException as exc:
                queue.put_nowait(exc)
                raise
            finally:
                queue.put_nowait(None)

        tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(self._streams)]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                position, delta = item
                index = position * n + delta.index
                self.timings[index].mark(time.monotonic(), len(delta.token_ids))
                self.output_tokens[index] = delta.num_output_tokens
                self.reasoning_tokens[index] = delta.num_reasoning_tokens
                if delta.finish_reason is not None:
                    self.finish_reasons[index] = delta.finish_reason
                yield index, delta
        finally:
            for task in tasks:
                task.cancel()
            self.close()

    def _engine_id(self, position: int) -> str:
        return self.request_id if len(self.prompts) == 1 else f"{self.request_id}-{position}"

    def record(self, status: str) -> None:
        """Observe this request in the metrics once it has ended (``status``: finish reason or HTTP code)."""
        end = time.monotonic()
        first_tokens = [t.first_token for t in self.timings.values() if t.first_token is not None]
        ttft = min(first_tokens) - self.arrival if first_tokens else None
        gaps = list(itertools.chain.from_iterable(t.gaps for t in self.timings.values()))
        self.metrics.observe_finished(
            self.endpoint, status, self.num_prompt_tokens, self.num_output_tokens, ttft, gaps, end - self.arrival
        )
        logger.info(
            "request_id=%s endpoint=%s status=%s prompt_tokens=%d output_tokens=%d ttft_ms=%s e2e_ms=%.1f",
            self.request_id,
            self.endpoint,
            status,
            self.num_prompt_tokens,
            self.num_output_tokens,
            f"{ttft * 1e3:.1f}" if ttft is not None else "-",
            (end - self.arrival) * 1e3,
        )


def finish_status(generation: Generation) -> str:
    reasons = set(generation.finish_reasons.values())
    return reasons.pop() if len(reasons) == 1 else "mixed" if reasons else "abort"
