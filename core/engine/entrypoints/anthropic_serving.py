"""``/v1/messages`` in the Anthropic Messages shape, whole or as its stream of events."""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_validator

from engine.entrypoints.errors import ParamError, bad_request, refusal
from engine.entrypoints.generation import Generation, PromptInput, check_text, new_request_id
from engine.entrypoints.openai_serving import OpenAIServing, collect
from engine.entrypoints.protocol import TextPart, UnsupportedParameter, join_text
from engine.sampling_params import SamplingParams

_STOP_REASONS = {"length": "max_tokens"}


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["user", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        return join_text(self.content)


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    max_tokens: StrictInt
    messages: list[AnthropicMessage]
    system: str | list[TextPart] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: StrictInt | None = Field(None, ge=0)
    stream: StrictBool = False
    metadata: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check(self) -> "MessagesRequest":
        if not self.messages:
            raise ParamError("messages", "messages must hold at least one message.")
        for name in ("tools", "tool_choice"):
            if getattr(self, name):
                raise UnsupportedParameter(name, "tool use is not supported by this server.")
        if self.thinking and self.thinking.get("type") != "disabled":
            raise UnsupportedParameter("thinking", "extended thinking is not supported by this server.")
        if any(s == "" for s in self.stop_sequences or []):
            raise ParamError("stop_sequences", "stop_sequences must not contain an empty string.")
        return self

    def system_text(self) -> str:
        return join_text(self.system)


class AnthropicServing:
    def __init__(self, openai: OpenAIServing) -> None:
        self.openai = openai

    async def messages(self, body: MessagesRequest, priority: int) -> Generation:
        serving = self.openai
        serving.check_model(body.model)
        tokenizer = serving.require_tokenizer("chat")
        conversation = []
        system = check_text(body.system_text(), "system")
        if system:
            conversation.append({"role": "system", "content": system})
        for i, message in enumerate(body.messages):
            conversation.append({"role": message.role, "content": check_text(message.text(), f"messages.{i}.content")})
        if not any(m["content"] for m in conversation):
            raise bad_request("Every message is empty: give some content.", param="messages")
        encoder = getattr(serving.engine, "chat_encoder", None)
        if encoder is not None:  # the model family's own prompt format
            try:
                text = encoder(conversation, add_generation_prompt=True, options={})
            except ValueError as exc:
                raise bad_request(f"The model's chat format rejected these messages: {exc}", param="messages") from None
        elif getattr(tokenizer, "chat_template", None) is None:
            raise bad_request("This model has no chat template.", param="messages")
        else:
            try:
                text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
            except Exception as exc:
                raise bad_request(f"The chat template rejected these messages: {exc}", param="messages") from None
        prompt = PromptInput(serving.check_ids(tokenizer.encode(text, add_special_tokens=False), "messages"), text)
        max_tokens = serving.max_tokens(body.max_tokens, [prompt], "max_tokens", "messages")
        fields = dict(n=1, max_tokens=max_tokens, stop=body.stop_sequences, seed=None)
        for name, value in serving.sampling_defaults.items():
            fields[name] = value
        for name in ("temperature", "top_p", "top_k"):
            if getattr(body, name) is not None:
                fields[name] = getattr(body, name)
        try:
            params = SamplingParams(**fields)
        except ValueError as exc:
            raise refusal(exc) from None
        return Generation(
            serving.engine, serving.metrics, "messages", new_request_id("msg", "_"), [prompt], params, priority
        )

    def _message(self, generation: Generation, content: str, finish: str | None, stop: Any) -> dict:
        stop_reason, stop_sequence = _stop_of(finish, stop)
        return {
            "id": generation.request_id,
            "type": "message",
            "role": "assistant",
            "model": self.openai.model_name,
            "content": [{"type": "text", "text": content}],
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": {"input_tokens": generation.num_prompt_tokens, "output_tokens": generation.num_output_tokens},
        }

    async def whole(self, generation: Generation) -> dict:
        sample = (await collect(generation))[0]
        return self._message(generation, sample.text, sample.finish_reason, sample.stop_reason)

    async def stream(self, generation: Generation) -> AsyncIterator[str]:
        start = self._message(generation, "", None, None)
        start["content"] = []
        start["usage"]["output_tokens"] = 0
        yield _event("message_start", {"type": "message_start", "message": start})
        yield _event(
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        )
        yield _event("ping", {"type": "ping"})
        finish = stop = None
        async for _, delta in generation.deltas():
            if delta.text:
                yield _event(
                    "content_block_delta",
                    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": delta.text}},
                )
            if delta.finish_reason is not None:
                finish, stop = delta.finish_reason, delta.stop_reason
        yield _event("content_block_stop", {"type": "content_block_stop", "index": 0})
        stop_reason, stop_sequence = _stop_of(finish, stop)
        yield _event(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                "usage": {"output_tokens": generation.num_output_tokens},
            },
        )
        yield _event("message_stop", {"type": "message_stop"})


def _stop_of(finish: str | None, stop: Any) -> tuple[str | None, str | None]:
    if finish is None:
        return None, None
    if finish == "stop" and isinstance(stop, str):
        return "stop_sequence", stop
    return _STOP_REASONS.get(finish, "end_turn"), None


def _event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"
