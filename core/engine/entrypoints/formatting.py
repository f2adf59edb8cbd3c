"""The OpenAI response shapes of a generation: whole choices collected from its stream,
the completion and chat formatters (one JSON body, or server-sent events), and usage."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from engine.entrypoints.generation import Generation
from engine.runtime.logprobs import LogprobEntry


def token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)


def usage_of(generation: Generation) -> dict:
    prompt_tokens = sum(len(p.token_ids) for p in generation.prompts)
    completion = generation.num_output_tokens
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


@dataclass
class Sample:
    """One choice, whole: its text, logprob entries (when asked for) and how it ended."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[LogprobEntry] | None = None
    finish_reason: str | None = None
    stop_reason: Any = None
    prompt_logprobs: list[LogprobEntry] | None = None


async def collect(generation: Generation) -> list[Sample]:
    """Run ``generation`` to the end; one ``Sample`` per choice index."""
    samples = [Sample() for _ in range(len(generation.prompts) * generation.params.n)]
    async for index, delta in generation.deltas():
        sample = samples[index]
        sample.text += delta.text
        sample.token_ids += delta.token_ids
        if delta.logprobs is not None:
            sample.logprobs = (sample.logprobs or []) + list(delta.logprobs)
        if delta.finish_reason is not None:
            sample.finish_reason, sample.stop_reason = delta.finish_reason, delta.stop_reason
        if delta.prompt_logprobs is not None:
            sample.prompt_logprobs = delta.prompt_logprobs
    return samples


class CompletionFormatter:
    """Completions: whole responses and stream chunks. ``prompt_part(index, prompt logprob
    entries)`` gives what a choice carries of its prompt (echo, vLLM's ``prompt_logprobs``);
    ``score_only``: the output is dropped (echo with max_tokens 0)."""

    def __init__(
        self, chunk: Callable, choice: Callable, logprobs_of: Callable, prompt_part: Callable, *, score_only: bool
    ) -> None:
        self.chunk, self.choice, self.logprobs_of = chunk, choice, logprobs_of
        self.prompt_part, self.score_only = prompt_part, score_only

    def usage(self, generation: Generation) -> dict:
        usage = usage_of(generation)
        if self.score_only:
            usage["completion_tokens"], usage["total_tokens"] = 0, usage["prompt_tokens"]
        return usage

    def _with_prompt(self, index: int, entries: Any, text: str, logprobs: dict | None, first: bool) -> tuple:
        """``text`` and ``logprobs`` of a choice's piece, led by its prompt's on its first piece."""
        if self.score_only:
            text, logprobs = "", None
        if not first:
            return text, logprobs, None
        echoed, echoed_logprobs, vllm = self.prompt_part(index, entries)
        if echoed_logprobs is not None:
            merged = {key: list(values) for key, values in echoed_logprobs.items()}
            if logprobs:
                for key in ("tokens", "token_logprobs", "top_logprobs"):
                    merged[key] += logprobs[key]
                merged["text_offset"] += [offset + len(echoed) for offset in logprobs["text_offset"]]
            logprobs = merged
        return echoed + text, logprobs, vllm

    async def whole(self, generation: Generation) -> dict:
        samples = await collect(generation)
        n = generation.params.n
        choices = []
        for i, s in enumerate(samples):
            entries = samples[i - i % n].prompt_logprobs  # the prompt's entries come with its first sample
            text, logprobs, vllm = self._with_prompt(i, entries, s.text, self.logprobs_of(s.logprobs, 0), True)
            choice = self.choice(i, text, logprobs, s.finish_reason, s.stop_reason, s.token_ids)
            if vllm is not None:
                choice["prompt_logprobs"] = vllm
            choices.append(choice)
        return self.chunk(choices, self.usage(generation))

    async def stream(self, generation: Generation, include_usage: bool) -> AsyncIterator[str]:
        offsets: dict[int, int] = {}
        entries: dict[int, Any] = {}  # prompt position -> its prompt logprob entries, once they came
        n = generation.params.n
        async for index, delta in generation.deltas():
            if delta.prompt_logprobs is not None:
                entries[index // n] = delta.prompt_logprobs
            if not (delta.text or delta.finish_reason or delta.token_ids):
                continue
            first = index not in offsets
            offset = offsets.get(index, 0)
            text, logprobs, vllm = self._with_prompt(
                index, entries.get(index // n), delta.text, self.logprobs_of(delta.logprobs, offset), first
            )
            offsets[index] = offset + len(text)
            choice = self.choice(index, text, logprobs, delta.finish_reason, delta.stop_reason, delta.token_ids)
            if vllm is not None:
                choice["prompt_logprobs"] = vllm
            yield sse(self.chunk([choice]))
        if include_usage:
            yield sse(self.chunk([], self.usage(generation)))
        yield "data: [DONE]\n\n"


class ChatFormatter:
    """Chat completions: whole responses and stream chunks, each choice's output read by its
    ``OutputReader`` into reasoning, content and tool calls."""

    def __init__(
        self, chunk: Callable, logprobs_of: Callable, readers: list, *, include_reasoning: bool, reasoning: bool
    ) -> None:
        self.chunk, self.logprobs_of, self.readers = chunk, logprobs_of, readers
        self.include_reasoning = include_reasoning
        self.reasoning = reasoning  # a reasoning parser is on: usage counts reasoning tokens

    def usage(self, generation: Generation) -> dict:
        usage = usage_of(generation)
        if self.reasoning:
            usage["completion_tokens_details"] = {"reasoning_tokens": generation.num_reasoning_tokens}
        return usage

    def _reader(self, index: int) -> Any:
        return self.readers[index % len(self.readers)]

    async def whole(self, generation: Generation) -> dict:
        choices = []
        for i, s in enumerate(await collect(generation)):
            read = self._reader(i).read(s.text)
            message: dict[str, Any] = {"role": "assistant", "content": read.content}
            if read.tool_calls:
                message["content"] = read.content if read.content.strip() else None
                message["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in read.tool_calls
                ]
            if read.reasoning is not None and self.include_reasoning:
                message["reasoning_content"] = message["reasoning"] = read.reasoning
            choices.append(
                {
                    "index": i,
                    "message": message,
                    "logprobs": self.logprobs_of(s.logprobs, 0),
                    "finish_reason": _finish_reason(s.finish_reason, bool(read.tool_calls)),
                    "stop_reason": s.stop_reason,
                }
            )
        return self.chunk(choices, self.usage(generation), stream=False)

    async def stream(self, generation: Generation, include_usage: bool) -> AsyncIterator[str]:
        for i in range(generation.params.n):
            first = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            yield sse(self.chunk([first], stream=True))
        called: set[int] = set()
        async for index, delta in generation.deltas():
            if not (delta.text or delta.finish_reason or delta.token_ids):
                continue
            reader = self._reader(index)
            read = reader.feed(delta.text) if delta.text else None
            if delta.finish_reason is not None:
                last = reader.finish()
                read = last if read is None else _join(read, last)
            content: dict[str, Any] = {}
            if read is not None:
                if read.reasoning and self.include_reasoning:
                    content["reasoning_content"] = content["reasoning"] = read.reasoning
                if read.content:
                    content["content"] = read.content
                if read.tool_calls:
                    called.add(index)
                    content["tool_calls"] = [_call_delta(c) for c in read.tool_calls]
            if not content and delta.finish_reason is None and not delta.logprobs:
                continue  # text held back (it may begin a marker)
            choice = {
                "index": index,
                "delta": content,
                "logprobs": self.logprobs_of(delta.logprobs, 0),
                "finish_reason": _finish_reason(delta.finish_reason, index in called),
            }
            if delta.finish_reason is not None:
                choice["stop_reason"] = delta.stop_reason
            yield sse(self.chunk([choice], stream=True))
        if include_usage:
            yield sse(self.chunk([], self.usage(generation), stream=True))
        yield "data: [DONE]\n\n"


def _finish_reason(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason


def _join(a: Any, b: Any) -> Any:
    a.reasoning += b.reasoning
    a.content += b.content
    a.tool_calls.extend(b.tool_calls)
    return a


def _call_delta(call: Any) -> dict:
    """A tool-call delta as OpenAI streams it: the first one of a call carries its id, type
    and name, the rest only argument fragments."""
    if call.name is not None:
        return {
            "index": call.index,
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
    return {"index": call.index, "function": {"arguments": call.arguments}}


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"
