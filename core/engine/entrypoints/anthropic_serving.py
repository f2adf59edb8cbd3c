"""``/v1/messages`` in the Anthropic Messages shape, whole or as its stream of events, with
tool use (``tool_use`` / ``tool_result`` blocks) and extended thinking; and
``/v1/messages/count_tokens``."""

from __future__ import annotations

import json
from typing import Annotated, Any, AsyncIterator, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_validator

from engine.entrypoints.errors import ParamError, bad_request, refusal
from engine.entrypoints.generation import Generation, PromptInput, check_text, new_request_id
from engine.entrypoints.openai_serving import OpenAIServing, collect
from engine.entrypoints.protocol import MAX_STOP_STRINGS, TextPart, checked, join_text
from engine.entrypoints.tool_calling import OutputReader, ToolChoice, check_tools
from engine.interfaces.tool_parser import Tool
from engine.sampling_params import SamplingParams

_STOP_REASONS = {"length": "max_tokens"}
MAX_STOP_SEQUENCES = MAX_STOP_STRINGS  # as the OpenAI endpoints' stop


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # accepted; the prefix cache needs no hint
    citations: list[dict[str, Any]] | None = None  # accepted on assistant turns; not rendered


class ToolUseBlock(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["tool_use"]
    id: str = Field(..., min_length=1)
    name: str = Field(..., min_length=1)
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["tool_result"]
    tool_use_id: str = Field(..., min_length=1)
    content: str | list[TextPart] | None = None
    is_error: StrictBool = False
    cache_control: dict[str, Any] | None = None

    def text(self) -> str:
        return join_text(self.content)


class ThinkingBlock(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[
    Union[TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, RedactedThinkingBlock], Field(discriminator="type")
]


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    @model_validator(mode="after")
    def _check_blocks(self) -> "AnthropicMessage":
        if isinstance(self.content, list):
            for block in self.content:
                if self.role == "user" and isinstance(block, (ToolUseBlock, ThinkingBlock, RedactedThinkingBlock)):
                    raise ValueError(f"a user message cannot hold a {block.type} block (only the assistant's can)")
                if self.role == "assistant" and isinstance(block, ToolResultBlock):
                    raise ValueError("an assistant message cannot hold a tool_result block (it goes in a user message)")
        return self

    def blocks(self) -> list[Any]:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else list(self.content)


class AnthropicTool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class AnthropicToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: StrictBool = False

    @model_validator(mode="after")
    def _check(self) -> "AnthropicToolChoice":
        if self.type == "tool" and not self.name:
            raise ValueError("tool_choice of type 'tool' needs the name of the tool")
        if self.type != "tool" and self.name is not None:
            raise ValueError(f"tool_choice of type {self.type!r} takes no name")
        return self


class ThinkingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["enabled", "disabled"]
    budget_tokens: StrictInt | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _check(self) -> "ThinkingConfig":
        if self.type == "enabled" and self.budget_tokens is None:
            raise ValueError("thinking of type 'enabled' needs budget_tokens")
        return self


class CountTokensRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    messages: list[AnthropicMessage] = Field(..., json_schema_extra=checked(minItems=1))
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None

    @model_validator(mode="after")
    def _check(self) -> "CountTokensRequest":
        if not self.messages:
            raise ParamError("messages", "messages must hold at least one message.")
        if self.tool_choice is not None and self.tool_choice.type != "none" and not self.tools:
            raise ParamError("tool_choice", "tool_choice needs tools: declare the tools the model may use.")
        return self

    def system_text(self) -> str:
        return (
            ""
            if self.system is None
            else (self.system if isinstance(self.system, str) else "".join(b.text for b in self.system))
        )


class MessagesRequest(CountTokensRequest):
    max_tokens: StrictInt = Field(..., json_schema_extra=checked(minimum=1))
    stop_sequences: list[str] | None = Field(
        None, json_schema_extra=checked(maxItems=MAX_STOP_SEQUENCES, items={"minLength": 1})
    )
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: StrictInt | None = Field(None, ge=0)
    stream: StrictBool = False
    metadata: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_stops(self) -> "MessagesRequest":
        if any(s == "" for s in self.stop_sequences or []):
            raise ParamError("stop_sequences", "stop_sequences must not contain an empty string.")
        if len(self.stop_sequences or []) > MAX_STOP_SEQUENCES:
            raise ParamError("stop_sequences", f"at most {MAX_STOP_SEQUENCES} stop_sequences.")
        if (
            self.thinking is not None
            and self.thinking.type == "enabled"
            and self.thinking.budget_tokens >= self.max_tokens
        ):
            raise ParamError("thinking.budget_tokens", "thinking.budget_tokens must be less than max_tokens.")
        return self


class AnthropicServing:
    def __init__(self, openai: OpenAIServing) -> None:
        self.openai = openai

    def conversation(self, body: CountTokensRequest) -> list[dict]:
        """The messages as chat templates read them (OpenAI's roles): tool_use blocks as the
        assistant's tool_calls, each tool_result as a tool message after the call it answers."""
        conversation: list[dict] = []
        system = check_text(body.system_text(), "system")
        if system:
            conversation.append({"role": "system", "content": system})
        open_calls: dict[str, str] = {}
        for i, message in enumerate(body.messages):
            where = f"messages.{i}.content"
            if message.role == "assistant":
                text, reasoning, calls = "", None, []
                for k, block in enumerate(message.blocks()):
                    if isinstance(block, TextBlock):
                        text += check_text(block.text, f"{where}.{k}.text")
                    elif isinstance(block, ThinkingBlock):
                        reasoning = (reasoning or "") + check_text(block.thinking, f"{where}.{k}.thinking")
                    elif isinstance(block, ToolUseBlock):
                        calls.append(
                            {
                                "id": block.id,
                                "type": "function",
                                "function": {"name": block.name, "arguments": block.input},
                            }
                        )
                entry: dict[str, Any] = {"role": "assistant", "content": text}
                if reasoning is not None:
                    entry["reasoning_content"] = reasoning
                if calls:
                    entry["tool_calls"] = calls
                open_calls = {c["id"]: c["function"]["name"] for c in calls}
                conversation.append(entry)
                continue
            text = ""
            for k, block in enumerate(message.blocks()):
                if isinstance(block, ToolResultBlock):
                    if block.tool_use_id not in open_calls:
                        raise bad_request(
                            f"{where}.{k}: the tool_result answers tool_use_id {block.tool_use_id!r}, but the "
                            f"assistant message before it has no unanswered tool_use block with that id.",
                            param=f"{where}.{k}.tool_use_id",
                        )
                    result = check_text(block.text(), f"{where}.{k}.content")
                    conversation.append(
                        {
                            "role": "tool",
                            "tool_call_id": block.tool_use_id,
                            "name": open_calls.pop(block.tool_use_id),
                            "content": f"Error: {result}" if block.is_error else result,
                        }
                    )
                else:
                    text += check_text(block.text, f"{where}.{k}.text")
            open_calls = {}
            if text or not any(isinstance(b, ToolResultBlock) for b in message.blocks()):
                conversation.append({"role": "user", "content": text})
        if not any(m["content"] or m.get("tool_calls") for m in conversation):
            raise bad_request("Every message is empty: give some content.", param="messages")
        return conversation

    def _tools(self, body: CountTokensRequest) -> tuple[list[Tool], ToolChoice]:
        tools = check_tools(
            [(t.name, t.description, t.input_schema) for t in body.tools or []], "tools", "name", "input_schema"
        )
        chosen = body.tool_choice
        mode = {"any": "required", "tool": "named"}.get(chosen.type, chosen.type) if chosen is not None else None
        parallel = not (chosen is not None and chosen.disable_parallel_tool_use)
        param = "tool_choice.name" if mode == "named" else "tool_choice"
        choice = self.openai.chat_tools.choice(tools, mode, chosen.name if chosen else None, parallel, param)
        return tools, choice

    def _prompt(self, body: CountTokensRequest, tools: list[Tool]) -> PromptInput:
        options: dict[str, Any] = {}
        if body.thinking is not None:
            enabled = body.thinking.type == "enabled"
            # the model family's encoder takes "thinking"; Hugging Face templates read "enable_thinking"
            encoder = getattr(self.openai.engine, "chat_encoder", None)
            options = (
                {"thinking": enabled} if encoder is not None else {"enable_thinking": enabled, "thinking": enabled}
            )
        return self.openai.render_chat(self.conversation(body), tools, options)

    async def count_tokens(self, body: CountTokensRequest) -> dict:
        self.openai.check_model(body.model)
        tools, _ = self._tools(body)
        return {"input_tokens": len((await self.openai.off_loop(self._prompt, body, tools)).token_ids)}

    async def messages(self, body: MessagesRequest, priority: int) -> tuple[Generation, OutputReader]:
        serving = self.openai
        serving.check_model(body.model)
        tools, choice = self._tools(body)
        prompt = await serving.off_loop(self._prompt, body, tools)
        max_tokens = serving.max_tokens(body.max_tokens, [prompt], "max_tokens", "messages")
        fields: dict[str, Any] = dict(n=1, max_tokens=max_tokens, stop=body.stop_sequences, seed=None)
        for name, value in serving.sampling_defaults.items():
            fields[name] = value
        for name in ("temperature", "top_p", "top_k"):
            if getattr(body, name) is not None:
                fields[name] = getattr(body, name)
        budget = body.thinking.budget_tokens if body.thinking is not None and body.thinking.type == "enabled" else None
        fields.update(serving.reasoning_fields(prompt, budget, choice, "thinking.budget_tokens"))
        constraint = serving.chat_tools.constraint(tools, choice, "tool_choice")
        if constraint is not None:
            fields["structured_outputs"] = constraint
        try:
            params = SamplingParams(**fields)
        except ValueError as exc:
            raise refusal(exc) from None
        generation = Generation(
            serving.engine, serving.metrics, "messages", new_request_id("msg", "_"), [prompt], params, priority
        )
        if constraint is not None:
            generation.constraint_param = "tool_choice"
        return generation, serving.chat_tools.reader(tools, choice, prompt.text, id_prefix="toolu_")

    def _message(self, generation: Generation, content: list[dict], finish: str | None, stop: Any) -> dict:
        stop_reason, stop_sequence = _stop_of(finish, stop, any(b["type"] == "tool_use" for b in content))
        return {
            "id": generation.request_id,
            "type": "message",
            "role": "assistant",
            "model": self.openai.model_name,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": {"input_tokens": generation.num_prompt_tokens, "output_tokens": generation.num_output_tokens},
        }

    async def whole(self, generation: Generation, reader: OutputReader) -> dict:
        sample = (await collect(generation))[0]
        read = reader.read(sample.text)
        content: list[dict] = []
        if read.reasoning is not None:
            content.append({"type": "thinking", "thinking": read.reasoning, "signature": ""})
        if read.content or not read.tool_calls:
            content.append({"type": "text", "text": read.content})
        for call in read.tool_calls:
            content.append({"type": "tool_use", "id": call.id, "name": call.name, "input": _input_of(call.arguments)})
        return self._message(generation, content, sample.finish_reason, sample.stop_reason)

    async def stream(self, generation: Generation, reader: OutputReader) -> AsyncIterator[str]:
        start = self._message(generation, [], None, None)
        start["usage"]["output_tokens"] = 0
        yield _event("message_start", {"type": "message_start", "message": start})
        blocks = _BlockStream()
        finish = stop = None
        async for _, delta in generation.deltas():
            read = reader.feed(delta.text) if delta.text else None
            if delta.finish_reason is not None:
                finish, stop = delta.finish_reason, delta.stop_reason
                last = reader.finish()
                for event in blocks.events(last) if read is None else [*blocks.events(read), *blocks.events(last)]:
                    yield event
                continue
            if read is not None:
                for event in blocks.events(read):
                    yield event
        for event in blocks.close(empty_text=True):
            yield event
        stop_reason, stop_sequence = _stop_of(finish, stop, blocks.used_tools)
        yield _event(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                "usage": {"output_tokens": generation.num_output_tokens},
            },
        )
        yield _event("message_stop", {"type": "message_stop"})


class _BlockStream:
    """The content-block events of a streamed message: a block opens when the kind of what
    comes changes (thinking, text, a tool call) and closes before the next opens."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None
        self.call: int | None = None  # the tool call the open tool_use block holds
        self.used_tools = False

    def _open(self, kind: str, block: dict) -> list[str]:
        events = self.close()
        self.index += 1
        self.kind = kind
        events.append(
            _event("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block})
        )
        if self.index == 0:  # Anthropic's order: the first block's start, then a ping
            events.append(_event("ping", {"type": "ping"}))
        return events

    def close(self, empty_text: bool = False) -> list[str]:
        events = []
        if self.kind is None and empty_text and self.index < 0:  # a message with no content at all: one empty text
            events += self._open("text", {"type": "text", "text": ""})
        if self.kind is not None:
            if self.kind == "thinking":
                events.append(self._delta({"type": "signature_delta", "signature": ""}))
            events.append(_event("content_block_stop", {"type": "content_block_stop", "index": self.index}))
            self.kind = None
        return events

    def _delta(self, delta: dict) -> str:
        return _event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def events(self, read: Any) -> list[str]:
        events: list[str] = []
        if read.reasoning:
            if self.kind != "thinking":
                events += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": read.reasoning}))
        if read.content:
            if self.kind != "text":
                events += self._open("text", {"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": read.content}))
        for call in read.tool_calls:
            if call.name is not None:
                self.used_tools = True
                events += self._open("tool_use", {"type": "tool_use", "id": call.id, "name": call.name, "input": {}})
                self.call = call.index
            if call.arguments and self.kind == "tool_use" and self.call == call.index:
                events.append(self._delta({"type": "input_json_delta", "partial_json": call.arguments}))
        return events


def _input_of(arguments: str) -> dict:
    value = json.loads(arguments)
    return value if isinstance(value, dict) else {}


def _stop_of(finish: str | None, stop: Any, used_tools: bool = False) -> tuple[str | None, str | None]:
    if finish is None:
        return None, None
    if finish == "stop" and isinstance(stop, str):
        return "stop_sequence", stop
    if finish == "stop" and used_tools:
        return "tool_use", None
    return _STOP_REASONS.get(finish, "end_turn"), None


def _event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"
