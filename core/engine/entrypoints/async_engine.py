"""The engine loop on its own thread, and an asyncio face for the server.

``LLMEngine`` is not thread-safe, so one thread (``engine-loop``) owns it: it
takes commands (add, abort) from a queue, steps while anything runs, and hands
each request's new tokens, text and logprobs to the asyncio queue of the
coroutine that is waiting for them. The HTTP event loop never runs the model.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Callable

from engine.engine.llm_engine import LLMEngine
from engine.engine.stats import EngineStats
from engine.errors import WorkerDiedError
from engine.runtime.logprobs import LogprobEntry
from engine.runtime.request import Request
from engine.sampling_params import SamplingParams
from engine.spec_decode.decoder import SpecDecodeStats

logger = logging.getLogger("engine.server")


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an error; no request can run any more.

    Its message is safe to show a client: the cause is in the server log only."""

    def __init__(self, cause: BaseException | None = None) -> None:
        what = "a tensor-parallel worker went away" if isinstance(cause, WorkerDiedError) else "an internal error"
        super().__init__(f"The engine stopped on {what} and cannot serve requests; see the server log.")


class ServerShuttingDown(RuntimeError):
    """The server stopped the request while shutting down (it ran past the shutdown timeout)."""

    def __init__(self, timeout: float) -> None:
        super().__init__(
            f"The server is shutting down and stopped this request, which was still running {timeout:g} s after "
            f"the shutdown began; send it again to a server that is up."
        )


@dataclass
class SampleDelta:
    """What one sample of a request gained in one engine step."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[LogprobEntry] | None  # one entry per new token, when logprobs were asked for
    finish_reason: str | None = None  # "stop", "length" or "abort" on the last delta
    stop_reason: int | str | None = None
    num_output_tokens: int = 0  # output tokens of this sample so far
    num_reasoning_tokens: int = 0  # of which in its reasoning block (when its params name reasoning markers)
    # the prompt's logprob entries (one per prompt token after the first), once, with sample 0's first
    # delta, when prompt_logprobs were asked for
    prompt_logprobs: list[LogprobEntry] | None = None


@dataclass
class _Stream:
    """The consumer of one request group: an asyncio queue on the server's loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    num_samples: int
    running: set[str] = field(default_factory=set)  # engine ids of the samples not finished yet
    emitted_tokens: dict[int, int] = field(default_factory=dict)  # sample index -> output tokens sent
    emitted_logprobs: dict[int, int] = field(default_factory=dict)
    prompt_logprobs_sent: bool = False


@dataclass
class KVTierCounters:
    """What /metrics shows of the KV tier."""

    tier: str  # the tier's name
    counters: dict[str, float]  # the KVTierStats counters, and the engine's transfers as engine_<name>
    extra_counters: dict[str, float]  # KVTierStats.extra_counters: the ones this tier adds


def _tier_counters(connector) -> KVTierCounters | None:
    if connector is None:
        return None
    stats = connector.tier.stats()
    counters = {k: float(v) for k, v in stats.as_dict().items() if k not in ("extra", "extra_counters")}
    counters.update({f"engine_{k}": float(v) for k, v in vars(connector.stats).items()})
    extra_counters = {k: float(v) for k, v in stats.extra_counters.items()}
    return KVTierCounters(connector.tier.name, counters, extra_counters)


class RequestStream:
    """The deltas of one added request group, in engine order."""

    def __init__(self, engine: AsyncEngine, request_id: str, stream: _Stream) -> None:
        self.engine = engine
        self.request_id = request_id
        self._stream = stream
        self._finished_samples = 0

    @property
    def finished(self) -> bool:
        return self._finished_samples >= self._stream.num_samples

    def __aiter__(self) -> AsyncIterator[SampleDelta]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[SampleDelta]:
        while not self.finished:
            item = await self._stream.queue.get()
            if isinstance(item, BaseException):
                raise item
            for delta in item:
                if delta.finish_reason is not None:
                    self._finished_samples += 1
                yield delta

    def close(self) -> None:
        """Abort the request unless every sample has finished (idempotent)."""
        if not self.finished:
            self._finished_samples = self._stream.num_samples
            self.engine.abort(self.request_id)


class AsyncEngine:
    """Runs an ``LLMEngine`` on a dedicated thread; ``generate`` is an async iterator of deltas.

    Thread-safety: every public method may be called from any thread; the
    ``LLMEngine`` itself is touched by the loop thread only.
    """

    def __init__(
        self,
        engine: LLMEngine,
        *,
        on_step: Callable[[EngineStats], None] | None = None,
        on_error: Callable[[BaseException], None] | None = None,
    ) -> None:
        """``on_error(exc)`` is called on the loop thread once the loop stopped on ``exc``,
        after every waiting request was told."""
        self.engine = engine
        self.on_step = on_step
        self.on_error = on_error
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}  # loop thread only
        self._group_of: dict[str, str] = {}  # sample request id -> group id (loop thread only)
        self.stats = EngineStats()
        self.error: BaseException | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._threads = _torch_threads()
        self._refresh_stats()
        self._thread.start()

    # the public face (any thread)

    @property
    def is_alive(self) -> bool:
        return self.error is None and self._thread.is_alive()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def chat_encoder(self) -> Any:
        return self.engine.chat_encoder

    @property
    def tool_parser_cls(self) -> type | None:
        return self.engine.setup.tool_parser_cls

    @property
    def reasoning_parser_cls(self) -> type | None:
        return self.engine.setup.reasoning_parser_cls

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    async def add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        prompt: str | None = None,
        group: str | None = None,
    ) -> RequestStream:
        """Add the request (``params.n`` samples); returns its stream of deltas. ``group``: the
        client request it belongs to (seats are shared fairly between groups).

        Raises the engine's ``ValueError`` for a request it refuses. The caller
        must ``close()`` the stream: closing it before every sample finished (a
        client went away) aborts the request.
        """
        if not self.is_alive:
            raise EngineDeadError(self.error)
        if params.structured_outputs is not None:  # compiled here, so that the engine loop never waits on it
            compile_constraint = self.engine.structured_output.compile
            await asyncio.get_running_loop().run_in_executor(None, compile_constraint, params.structured_outputs)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), params.n)
        added: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("add", (request_id, prompt_token_ids, params, priority, prompt, group, stream), added))
        try:
            await asyncio.wrap_future(added)  # raises what add_request_group raised
        except asyncio.CancelledError:
            self.abort(request_id)  # the caller left while the add was queued
            raise
        return RequestStream(self, request_id, stream)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        prompt: str | None = None,
        group: str | None = None,
    ) -> AsyncIterator[SampleDelta]:
        """``add`` then iterate: every sample's deltas; leaving early aborts the request."""
        stream = await self.add(request_id, prompt_token_ids, params, priority=priority, prompt=prompt, group=group)
        try:
            async for delta in stream:
                yield delta
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        """Abort a request group; its blocks are freed before the next step."""
        self._commands.put(("abort", request_id, None))

    def call(self, fn: Callable[[LLMEngine], Any]) -> concurrent.futures.Future:
        """Run ``fn(engine)`` on the loop thread between steps (for tests and admin)."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("call", fn, done))
        return done

    def stop_requests(self, exc: BaseException) -> None:
        """Abort every running request; each one's stream raises ``exc`` (any thread)."""
        self._commands.put(("stop", exc, None))

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._commands.put(("wake", None, None))
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.engine.close()

    # the loop thread

    def _run(self) -> None:
        _set_torch_threads(self._threads)
        try:
            while not self._stopping.is_set():
                self._drain_commands(block=not self.engine.has_unfinished())
                if self._stopping.is_set():
                    break
                self.engine.check_ranks()  # a tensor-parallel rank that died while idle stops the loop too
                if self.engine.has_unfinished():
                    result = self.engine.step()
                    self._dispatch(result.updated, result.finished)
                    self._refresh_stats()
        except BaseException as exc:  # the engine is unusable: tell every waiting request
            logger.exception("engine loop stopped")
            self.error = exc
            for stream in self._streams.values():
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, EngineDeadError(exc))
            self._streams.clear()
            self._fail_pending_commands()
            if self.on_error is not None:
                self.on_error(exc)

    def _drain_commands(self, *, block: bool) -> None:
        while True:
            try:
                command, arg, future = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
            except queue.Empty:
                return
            block = False
            if command == "add":
                self._add(arg, future)
            elif command == "abort":
                self._abort(arg)
            elif command == "stop":
                for group_id, stream in list(self._streams.items()):
                    self.engine.abort(group_id)
                    stream.loop.call_soon_threadsafe(stream.queue.put_nowait, arg)
                self._streams.clear()
                self._group_of.clear()
            elif command == "call":
                try:
                    future.set_result(arg(self.engine))
                except BaseException as exc:
                    future.set_exception(exc)

    def _add(self, arg: tuple, future: concurrent.futures.Future) -> None:
        request_id, prompt_token_ids, params, priority, prompt, group, stream = arg
        try:
            samples = self.engine.add_request_group(
                request_id, prompt_token_ids, params, priority=priority, prompt=prompt, group=group
            )
        except BaseException as exc:
            future.set_exception(exc)
            return
        self._streams[request_id] = stream
        for request in samples:
            self._group_of[request.request_id] = request_id
            stream.running.add(request.request_id)
        future.set_result(None)
        self._refresh_stats()

    def _abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return  # finished already, or never added
        self.engine.abort(request_id)
        for rid in stream.running:
            del self._group_of[rid]
        self._refresh_stats()

    def _dispatch(self, updated: list[Request], finished: list[Request]) -> None:
        finished_ids = {r.request_id for r in finished}
        per_stream: dict[str, list[SampleDelta]] = {}
        for request in updated:
            group_id = self._group_of.get(request.request_id)
            stream = self._streams.get(group_id) if group_id is not None else None
            if stream is None:
                continue
            per_stream.setdefault(group_id, []).append(self._delta(stream, request, request.request_id in finished_ids))
        for group_id, deltas in per_stream.items():
            stream = self._streams[group_id]
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, deltas)
        for request in finished:
            group_id = self._group_of.pop(request.request_id, None)
            stream = self._streams.get(group_id) if group_id is not None else None
            if stream is not None:
                stream.running.discard(request.request_id)
                if not stream.running:
                    del self._streams[group_id]

    @staticmethod
    def _delta(stream: _Stream, request: Request, finished: bool) -> SampleDelta:
        index = request.index
        output = request.output_token_ids
        sent = stream.emitted_tokens.get(index, 0)
        stream.emitted_tokens[index] = len(output)
        logprobs = None
        if request.sampling_params.logprobs is not None:
            sent_lp = stream.emitted_logprobs.get(index, 0)
            logprobs = request.output_logprobs[sent_lp:]
            stream.emitted_logprobs[index] = len(request.output_logprobs)
        prompt_logprobs = None
        if request.sampling_params.prompt_logprobs is not None and not stream.prompt_logprobs_sent:
            if output or finished:  # the prompt has been computed
                prompt_logprobs = list(request.prompt_logprobs)
                stream.prompt_logprobs_sent = True
        return SampleDelta(
            prompt_logprobs=prompt_logprobs,
            index=index,
            text=request.take_output_text_delta(),
            token_ids=output[sent:],
            logprobs=logprobs,
            finish_reason=request.status.value if finished else None,
            stop_reason=request.stop_reason if finished else None,
            num_output_tokens=len(output),
            num_reasoning_tokens=request.reasoning.num_reasoning_tokens if request.reasoning is not None else 0,
        )

    def kv_tier_counters(self) -> KVTierCounters | None:
        """The KV tier's counters and the engine's transfers through it (None without a tier);
        read when /metrics is scraped rather than after every step (``KVTier.stats`` may be
        called from any thread)."""
        return _tier_counters(self.engine.kv_tier)

    def spec_decode_stats(self) -> SpecDecodeStats | None:
        """A copy of speculative decoding's counters (None without speculation), read when
        /metrics is scraped."""
        spec = self.engine.spec
        if spec is None:
            return None
        stats = spec.stats
        return replace(stats, proposed_at=list(stats.proposed_at), accepted_at=list(stats.accepted_at))

    def _refresh_stats(self) -> None:
        self.stats = self.engine.stats()
        if self.on_step is not None:
            self.on_step(self.stats)

    def _fail_pending_commands(self) -> None:
        while True:
            try:
                _, _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future is not None and not future.done():
                future.set_exception(EngineDeadError(self.error))


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _set_torch_threads(n: int) -> None:
    # the intra-op thread count is per calling thread under OpenMP: keep the one the platform chose
    import torch

    torch.set_num_threads(n)
