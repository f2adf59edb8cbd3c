"""One OpenAI-compatible request, sent and timed: its body, and the reading of its
streamed events (or whole response) into a :class:`RequestRecord`."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

from engine.bench.serve_load.http_client import ConnectError, Connection, Server, error_message
from engine.bench.serve_load.stats import RequestRecord

ENDPOINTS = {"completions": "/completions", "chat": "/chat/completions"}


@dataclass(frozen=True)
class RequestSettings:
    """What every request of a run shares."""

    endpoint: str  # a key of ENDPOINTS
    model: str
    stream: bool = True
    ignore_eos: bool = False
    api_key: str | None = None
    timeout: float = 600.0

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def body(self, prompt: str, output_len: int) -> dict[str, Any]:
        """Greedy, at most ``output_len`` tokens; with ``ignore_eos`` also vLLM's ``ignore_eos``
        and ``min_tokens``, so that servers that take them produce exactly ``output_len``."""
        if self.endpoint == "chat":
            body: dict[str, Any] = {
                "messages": [{"role": "user", "content": prompt}],
                "max_completion_tokens": output_len,
            }
        else:
            body = {"prompt": prompt, "max_tokens": output_len}
        body = {"model": self.model, **body, "temperature": 0.0}
        if self.ignore_eos:
            body.update(ignore_eos=True, min_tokens=output_len)
        if self.stream:
            body.update(stream=True, stream_options={"include_usage": True})
        return body


class StreamReader:
    """Reads a response's server-sent events into ``record``: each content chunk's time
    (``now - start``), the usage, an error event, and whether the stream was complete."""

    def __init__(self, record: RequestRecord, endpoint: str, start: float) -> None:
        self.record, self.endpoint, self.start = record, endpoint, start
        self.last_chunk: float | None = None
        self.done = False  # saw data: [DONE]
        self.finished = False  # a choice had its finish_reason
        self.error: str | None = None

    def feed(self, line: str, now: float) -> None:
        if self.error is not None or not line.startswith("data:"):
            return  # blank lines between events, comments, event names
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            self.done = True
            return
        try:
            event = json.loads(data)
        except ValueError:
            self.error = f"a stream event that is not JSON: {data[:120]!r}"
            return
        if not isinstance(event, dict):
            return
        error = event.get("error")
        if error:
            message = error.get("message") if isinstance(error, dict) else None
            self.error = f"error event in the stream: {message or json.dumps(error)[:200]}"
            return
        take_usage(self.record, event.get("usage"))
        for choice in event.get("choices") or []:
            if choice.get("finish_reason"):
                self.finished = True
            if content_of(choice, self.endpoint):
                self._content(now)

    def _content(self, now: float) -> None:
        record = self.record
        if self.last_chunk is None:
            record.ttft = now - self.start
        else:
            record.itl.append(now - self.last_chunk)
        self.last_chunk = now
        record.num_chunks += 1


def content_of(choice: dict, endpoint: str) -> str:
    """A choice's generated text: ``text`` (completions), or a chat delta's or message's
    content, reasoning included (it is output the model generated too)."""
    if endpoint != "chat":
        return choice.get("text") or ""
    part = choice.get("delta") or choice.get("message") or {}
    return part.get("content") or part.get("reasoning_content") or part.get("reasoning") or ""


def take_usage(record: RequestRecord, usage: Any) -> None:
    if isinstance(usage, dict):
        if isinstance(usage.get("prompt_tokens"), int):
            record.prompt_tokens = usage["prompt_tokens"]
        if isinstance(usage.get("completion_tokens"), int):
            record.completion_tokens = usage["completion_tokens"]


async def send(server: Server, settings: RequestSettings, prompt: str, record: RequestRecord, t0: float) -> None:
    """Send one request and fill ``record``; never raises for what the server or the network did."""
    start = time.perf_counter()
    record.start = start - t0
    try:
        await asyncio.wait_for(_exchange(server, settings, prompt, record, start), settings.timeout)
    except asyncio.TimeoutError:
        record.error = f"timed out after {settings.timeout:g} s"
    except ConnectError as exc:
        record.error = f"connection failed: {exc}"
    except (OSError, ValueError, asyncio.IncompleteReadError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    record.success = record.error is None
    if record.e2e is None:  # it failed: the time until it did
        record.e2e = time.perf_counter() - start


async def _exchange(
    server: Server, settings: RequestSettings, prompt: str, record: RequestRecord, start: float
) -> None:
    async with Connection(server) as connection:
        response = await connection.send(
            "POST", ENDPOINTS[settings.endpoint], settings.headers(), settings.body(prompt, record.output_len)
        )
        record.status = response.status
        if response.status != 200:
            record.error = error_message(response.status, await response.read())
            return
        if not settings.stream:
            reply = await response.json()
            record.e2e = time.perf_counter() - start
            take_usage(record, reply.get("usage"))
            choices = reply.get("choices") or []
            if not choices:
                record.error = "a response without choices"
            elif content_of(choices[0], settings.endpoint):
                record.num_chunks = 1
            return
        reader = StreamReader(record, settings.endpoint, start)
        async for line in response.lines():  # to the end of the body, as the server ends it
            reader.feed(line, time.perf_counter())
        record.e2e = time.perf_counter() - start
        if reader.error:
            record.error = reader.error
        elif not (reader.done or reader.finished):
            record.error = "the stream ended before its last event (no finish_reason, no [DONE])"
