"""Request bodies of the OpenAI-compatible endpoints, validated by pydantic.

Unknown fields are refused (``extra="forbid"``) so that a client never believes
a parameter took effect when it did not; fields that OpenAI defines and this
server cannot honour are refused with a message that says so.
"""

from __future__ import annotations

from typing import Any, Callable, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator

from engine.entrypoints.errors import ParamError
from engine.sampling_params import SEED_MAX, SEED_MIN, TOP_K_MAX

# text, a list of token ids, or a batch of either
PromptField = Union[str, list[StrictInt], list[str], list[list[StrictInt]]]
MAX_STOP_STRINGS = 16

# the JSON type each bound applies to ("number" covers "integer")
_KEYWORD_TYPES = {
    "minLength": "string",
    "maxLength": "string",
    "minItems": "array",
    "maxItems": "array",
    "items": "array",
    "minimum": "number",
    "maximum": "number",
    "maxProperties": "object",
}


def checked(**keywords: Any) -> Callable[[dict[str, Any]], None]:
    """``json_schema_extra`` for bounds the server checks itself, with messages of its own: each
    keyword joins the members of the field's schema it applies to (``maxItems`` the array,
    ``minimum`` the number; ``items`` is merged into an array's items), so the published schema
    states the bound while validation stays as it is."""

    def extra(schema: dict[str, Any]) -> None:
        for member in schema.get("anyOf", [schema]):
            kind = member.get("type")
            for keyword, value in keywords.items():
                wanted = _KEYWORD_TYPES[keyword]
                if kind == wanted or (wanted == "number" and kind == "integer"):
                    member[keyword] = {**member.get("items", {}), **value} if keyword == "items" else value

    return extra


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class JSONSchemaFormat(BaseModel):
    """``response_format.json_schema``: OpenAI's named schema."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(..., min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None


# what _check_format refuses, in JSON Schema: json_schema goes with (and only with) its type, and a
# structural tag needs structures
_FORMAT_SCHEMA = {
    "allOf": [
        {
            "if": {"properties": {"type": {"const": "json_schema"}}},
            "then": {"required": ["json_schema"], "properties": {"json_schema": {"not": {"type": "null"}}}},
            "else": {"properties": {"json_schema": {"type": "null"}}},
        },
        {
            "if": {"properties": {"type": {"const": "structural_tag"}}},
            "then": {"required": ["structures"], "properties": {"structures": {"type": "array", "minItems": 1}}},
        },
    ]
}


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``text``, ``json_object`` (any JSON object) or
    ``json_schema`` (an instance of ``json_schema.schema``); vLLM's ``structural_tag``."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=_FORMAT_SCHEMA)

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JSONSchemaFormat | None = None
    structures: list[dict[str, Any]] | None = None  # structural_tag
    triggers: list[str] | None = None  # structural_tag

    @model_validator(mode="after")
    def _check_format(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type 'json_schema' needs a json_schema object")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"json_schema is only for response_format type 'json_schema', not {self.type!r}")
        if self.type == "structural_tag" and not self.structures:
            raise ValueError("response_format of type 'structural_tag' needs structures")
        return self


class StructuredOutputsField(BaseModel):
    """vLLM's ``structured_outputs`` request object: exactly one constraint."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: StrictBool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: dict[str, Any] | str | None = None
    disable_any_whitespace: StrictBool = False


class _SamplingFields(BaseModel):
    """The sampling fields both endpoints share (OpenAI names, plus vLLM's extras)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    n: StrictInt = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: StrictInt | None = Field(None, ge=-1, json_schema_extra=checked(maximum=TOP_K_MAX))
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    seed: StrictInt | None = Field(None, json_schema_extra=checked(minimum=SEED_MIN, maximum=SEED_MAX))
    stop: str | list[str] | None = Field(
        None, json_schema_extra=checked(minLength=1, maxItems=MAX_STOP_STRINGS, items={"minLength": 1})
    )
    stop_token_ids: list[StrictInt] | None = Field(None, json_schema_extra=checked(items={"minimum": 0}))
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = Field(0, ge=0)
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted for compatibility; not used
    # refused unless empty
    logit_bias: dict[str, float] | None = Field(None, json_schema_extra=checked(maxProperties=0))
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        return value

    @model_validator(mode="after")
    def _check_unsupported(self) -> "_SamplingFields":
        if self.logit_bias:
            raise UnsupportedParameter("logit_bias", "logit_bias is not supported by this server.")
        if self.stream_options is not None and not self.stream:
            raise UnsupportedParameter("stream_options", "stream_options is only allowed when stream is true.")
        if (
            self.structured_outputs is not None
            and self.response_format not in (None,)
            and (self.response_format.type != "text")
        ):
            raise ParamError(
                "structured_outputs", "Give either response_format or structured_outputs, not both constraints."
            )
        return self


class UnsupportedParameter(ParamError):
    """A known OpenAI parameter this server does not implement: a 400 naming it."""

    code = "unsupported_parameter"


class CompletionRequest(_SamplingFields):
    prompt: PromptField
    max_tokens: StrictInt | None = Field(16, json_schema_extra=checked(minimum=0))  # 0 only with echo
    logprobs: StrictInt | None = Field(None, ge=0, le=20)
    prompt_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    echo: StrictBool = False
    return_token_ids: StrictBool = False  # vLLM: each choice also carries its token ids and its prompt's
    best_of: StrictInt | None = None
    suffix: str | None = Field(None, json_schema_extra=checked(maxLength=0))  # refused unless empty

    @model_validator(mode="after")
    def _check_completion(self) -> "CompletionRequest":
        if self.max_tokens == 0 and not self.echo:
            raise ParamError("max_tokens", "max_tokens may be 0 only with echo (to score the prompt alone).")
        if self.suffix:
            raise UnsupportedParameter("suffix", "suffix is not supported by this server.")
        if self.best_of is not None and self.best_of != self.n:
            raise UnsupportedParameter("best_of", "best_of must equal n (or be left out) on this server.")
        return self


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: str


def join_text(content: str | list[TextPart] | None) -> str:
    """A message's text: the string itself, or its text parts joined."""
    if content is None:
        return ""
    return content if isinstance(content, str) else "".join(part.text for part in content)


class FunctionCallParam(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str
    arguments: str  # the text of a JSON object


class ToolCallParam(BaseModel):
    """An assistant message's ``tool_calls[i]``: a call it made earlier in the conversation."""

    model_config = ConfigDict(extra="forbid", strict=True)

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallParam
    index: StrictInt | None = None  # what a client accumulated from a stream carries; not used


# what _check_tool_fields refuses, in JSON Schema: a tool message answers a call by its id, and only an
# assistant message carries tool calls
_TOOL_FIELDS_SCHEMA = {
    "allOf": [
        {
            "if": {"properties": {"role": {"const": "tool"}}},
            "then": {"required": ["tool_call_id"], "properties": {"tool_call_id": {"type": "string", "minLength": 1}}},
            "else": {"properties": {"tool_call_id": {"type": "null"}}},
        },
        {
            "if": {"properties": {"role": {"not": {"const": "assistant"}}}},
            "then": {"properties": {"tool_calls": {"type": "null"}}},
        },
    ]
}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=_TOOL_FIELDS_SCHEMA)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    reasoning_content: str | None = None  # an assistant turn's reasoning, as reasoning models return it
    reasoning: str | None = None  # the same, under vLLM's newer name
    tool_calls: list[ToolCallParam] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers

    @model_validator(mode="after")
    def _check_tool_fields(self) -> "ChatMessage":
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"only assistant messages carry tool_calls, not {self.role} messages")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError(f"only tool messages carry a tool_call_id, not {self.role} messages")
        return self

    def text(self) -> str:
        return join_text(self.content)


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str


class NamedToolChoice(BaseModel):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``: call that function."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: NamedFunction


# max_tokens is the output limit only without max_completion_tokens, which takes its place
CHAT_MAX_TOKENS_SCHEMA = {
    "if": {"required": ["max_completion_tokens"], "properties": {"max_completion_tokens": {"type": "integer"}}},
    "else": {"properties": {"max_tokens": {"minimum": 1}}},
}


class ChatCompletionRequest(_SamplingFields):
    model_config = ConfigDict(json_schema_extra=CHAT_MAX_TOKENS_SCHEMA)

    messages: list[ChatMessage] = Field(..., json_schema_extra=checked(minItems=1))
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = Field(None, json_schema_extra=checked(minimum=1))
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    add_generation_prompt: StrictBool = True
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None  # handed to the chat template (or the model's chat encoder)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    include_reasoning: StrictBool = True  # vLLM: leave reasoning_content out of the reply when false
    thinking_token_budget: StrictInt | None = Field(None, ge=0)
    max_reasoning_tokens: StrictInt | None = Field(None, ge=0)  # the same limit, under its other name

    @model_validator(mode="after")
    def _check_chat(self) -> "ChatCompletionRequest":
        if not self.messages:
            raise ParamError("messages", "messages must hold at least one message.")
        if self.top_logprobs is not None and not self.logprobs:
            raise UnsupportedParameter("top_logprobs", "top_logprobs needs logprobs set to true.")
        if (
            self.thinking_token_budget is not None
            and self.max_reasoning_tokens is not None
            and self.thinking_token_budget != self.max_reasoning_tokens
        ):
            raise ParamError(
                "max_reasoning_tokens", "thinking_token_budget and max_reasoning_tokens are one limit: give one."
            )
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ParamError("tool_choice", "tool_choice needs tools: declare the functions the model may call.")
        return self

    @property
    def reasoning_budget(self) -> int | None:
        return self.thinking_token_budget if self.thinking_token_budget is not None else self.max_reasoning_tokens

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
