"""Tools and reasoning on the chat endpoints, whatever the API's shape: the declared tools
checked, the tool choice turned into what the engine does (a constraint for ``required`` and
a named function), the reasoning markers and thinking budget handed to the engine, and each
sample's output read back into reasoning, content and tool calls, whole or as it streams.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

from engine.entrypoints.errors import bad_request
from engine.interfaces.reasoning_parser import ReasoningParser
from engine.interfaces.tool_parser import Tool, ToolCall, ToolCallDelta, ToolParser
from engine.sampling_params import ReasoningMarkers, StructuredOutputsParams

TOOL_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")  # the whole name (fullmatch: no trailing newline)


def check_tools(
    tools: Sequence[tuple[str, str | None, Any]],
    param: str,
    name_field: str = "function.name",
    schema_field: str = "function.parameters",
) -> list[Tool]:
    """``(name, description, schema)`` of each declared tool, checked: a valid, unique name and
    a JSON Schema of an object (or None: any object). Errors name ``{param}.{i}.{name_field}``
    or ``.{schema_field}`` (OpenAI's ``function.parameters``, Anthropic's ``input_schema``)."""
    import jsonschema

    schema_name = schema_field.rsplit(".", 1)[-1]
    checked: list[Tool] = []
    seen: dict[str, int] = {}
    for i, (name, description, parameters) in enumerate(tools):
        where = f"{param}.{i}"
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise bad_request(
                f"{where}: the tool name {name!r} must be 1 to 64 letters, digits, '_', '-', '.' or ':'.",
                param=f"{where}.{name_field}",
            )
        if name in seen:
            raise bad_request(
                f"{where}: the tool name {name!r} is already declared by {param}.{seen[name]}; names must be unique.",
                param=f"{where}.{name_field}",
            )
        seen[name] = i
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise bad_request(f"{where}: {schema_name} must be a JSON Schema object.", param=f"{where}.{schema_field}")
        try:
            jsonschema.validators.validator_for(parameters).check_schema(parameters)
        except jsonschema.SchemaError as exc:
            raise bad_request(
                f"{where}: {schema_name} is not a valid JSON Schema: {exc.message}", param=f"{where}.{schema_field}"
            ) from None
        kind = parameters.get("type")
        if kind is not None and kind != "object":
            raise bad_request(
                f"{where}: {schema_name} must describe an object (type 'object'), not {kind!r}.",
                param=f"{where}.{schema_field}",
            )
        checked.append(Tool(name=name, parameters=parameters, description=description))
    return checked


@dataclass(frozen=True)
class ToolChoice:
    """``mode``: ``none`` (no call is read), ``auto`` (the model decides), ``required`` (at
    least one call) or ``named`` (a call of ``name``); ``parallel``: more than one call may come."""

    mode: str
    name: str | None = None
    parallel: bool = True


def openai_arguments(arguments: str, param: str) -> dict:
    """An earlier call's arguments text, as the object chat templates render."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError as exc:
        raise bad_request(f"{param} is not valid JSON: {exc}.", param=param) from None
    if not isinstance(value, dict):
        raise bad_request(f"{param} must be the text of a JSON object.", param=param)
    return value


# what a sample's output holds


@dataclass
class ReadDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass
class ReadOutput:
    reasoning: str | None
    content: str
    tool_calls: list[ToolCall]


class OutputReader:
    """One sample's output, read: the reasoning first (with a reasoning parser), then, in
    what follows it, the tool calls (with a tool parser). Whole (:meth:`read`) or streamed
    (:meth:`feed` then :meth:`finish`), with the same result. Reasoning is never read for
    calls. Calls without an id of their own get one, the same in both."""

    def __init__(
        self,
        reasoning: ReasoningParser | None,
        tools: ToolParser | None,
        id_prefix: str = "call_",
        max_calls: int | None = None,
    ) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.id_prefix = id_prefix
        self.max_calls = max_calls  # calls after this many are dropped (parallel calls not wanted)
        self._reasoning_stream = reasoning.streamer() if reasoning is not None else None
        self._tool_stream = tools.streamer() if tools is not None else None
        self._ids: list[str] = []

    def _id(self, index: int, own: str | None) -> str:
        while len(self._ids) <= index:
            self._ids.append("")
        if not self._ids[index]:
            self._ids[index] = own or self.tools.new_call_id(self.id_prefix)
        return self._ids[index]

    def read(self, text: str) -> ReadOutput:
        reasoning, content = None, text
        if self.reasoning is not None:
            split = self.reasoning.split(text)
            reasoning, content = split.reasoning, split.content
        calls: list[ToolCall] = []
        if self.tools is not None:
            parsed = self.tools.parse(content)
            content = parsed.content
            calls = [
                ToolCall(c.name, c.arguments, self._id(i, c.id))
                for i, c in enumerate(parsed.tool_calls)
                if self.max_calls is None or i < self.max_calls
            ]
        return ReadOutput(reasoning, content, calls)

    def feed(self, text: str) -> ReadDelta:
        return self._step(text, final=False)

    def finish(self) -> ReadDelta:
        return self._step("", final=True)

    def _step(self, text: str, final: bool) -> ReadDelta:
        reasoning, content = "", text
        if self._reasoning_stream is not None:
            if text:
                reasoning, content = self._reasoning_stream.feed(text)
            if final:
                more_reasoning, more_content = self._reasoning_stream.finish()
                reasoning, content = reasoning + more_reasoning, content + more_content
        if self._tool_stream is None:
            return ReadDelta(reasoning, content)
        deltas = []
        for piece in (
            self._tool_stream.feed(content) if content else None,
            self._tool_stream.finish() if final else None,
        ):
            if piece is None:
                continue
            deltas.append(piece)
        out = ReadDelta(reasoning, "".join(d.content for d in deltas))
        for d in deltas:
            for call in d.tool_calls:
                if self.max_calls is not None and call.index >= self.max_calls:
                    continue
                if call.name is not None:
                    call = ToolCallDelta(call.index, call.name, self._id(call.index, call.id), call.arguments)
                out.tool_calls.append(call)
        return out


class ChatTools:
    """The server's tool-call and reasoning parsers (classes; None: not configured) and what
    a request with them needs from the engine."""

    def __init__(
        self,
        tool_parser: type[ToolParser] | None,
        reasoning_parser: type[ReasoningParser] | None,
        tokenizer: Any,
        enable_auto_tool_choice: bool = False,
    ) -> None:
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        self.tokenizer = tokenizer
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self._marker_ids: tuple | None = None

    def choice(self, tools: list[Tool], mode: str | None, name: str | None, parallel: bool, param: str) -> ToolChoice:
        """The tool choice of a request that declares ``tools``, checked against the server's setup."""
        if not tools:
            return ToolChoice("none")
        mode = mode or "auto"  # OpenAI's default when tools are declared
        if mode == "named" and name not in {t.name for t in tools}:
            raise bad_request(
                f"{param} names the function {name!r}, which is not among the declared tools "
                f"({', '.join(t.name for t in tools)}).",
                param=param,
            )
        if mode != "none" and self.tool_parser is None:
            raise bad_request(
                f"tool_choice {mode!r} needs a tool-call parser, and this server has none for its model: start it "
                f"with --tool-call-parser NAME (engine plugins lists them).",
                param=param,
            )
        if mode == "auto" and not self.enable_auto_tool_choice:
            raise bad_request(
                "tool_choice 'auto' needs the server started with --enable-auto-tool-choice; "
                "'required' or a named function work without it.",
                param=param,
            )
        return ToolChoice(mode, name, parallel and mode != "named")

    def constraint(self, tools: list[Tool], choice: ToolChoice, param: str) -> StructuredOutputsParams | None:
        """The structured-output constraint that forces ``required`` and named calls."""
        if choice.mode not in ("required", "named"):
            return None
        chosen = [t for t in tools if t.name == choice.name] if choice.mode == "named" else tools
        tag = self.tool_parser(tools).structural_tag(chosen, parallel=choice.parallel)
        if tag is None:
            raise bad_request(
                f"The tool-call parser {self.tool_parser.name!r} cannot force a call, so tool_choice "
                f"{'a named function' if choice.mode == 'named' else repr(choice.mode)} is not available; use 'auto'.",
                param=param,
            )
        return StructuredOutputsParams(structural_tag=tag)

    def reasoning_markers(self, prompt: str | None) -> ReasoningMarkers | None:
        if self.reasoning_parser is None or self.tokenizer is None:
            return None
        parser = self.reasoning_parser(self.tokenizer, prompt)
        if self._marker_ids is None:
            self._marker_ids = parser.marker_token_ids()
        start, end, forced = self._marker_ids
        return ReasoningMarkers(start, end, forced, parser.starts_in_reasoning())

    def needs_special_tokens(self, choice: ToolChoice) -> bool:
        """The output must be decoded with its special tokens for the parsers to see their markers."""
        return bool(
            (self.reasoning_parser is not None and self.reasoning_parser.special_tokens)
            or (choice.mode != "none" and self.tool_parser is not None and self.tool_parser.special_tokens)
        )

    def reader(
        self, tools: list[Tool], choice: ToolChoice, prompt: str | None, id_prefix: str = "call_"
    ) -> OutputReader:
        reasoning = self.reasoning_parser(self.tokenizer, prompt) if self.reasoning_parser is not None else None
        parser = self.tool_parser(tools) if choice.mode != "none" and self.tool_parser is not None else None
        return OutputReader(reasoning, parser, id_prefix, max_calls=None if choice.parallel else 1)
