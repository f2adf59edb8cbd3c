"""The tool-call parser interface: a model family's tool-call format, read out of its output.

A model announces a tool call in its own markup (Hermes ``<tool_call>{...}</tool_call>``,
DeepSeek's ``<｜tool▁call▁begin｜>`` tokens, Kimi's ``<|tool_call_begin|>``...). A
:class:`ToolParser` turns an output text into the text meant for the user (``content``) and
the calls, each a function name and its arguments as JSON text, as OpenAI's
``tool_calls`` carries them. It does so for a whole text (:meth:`ToolParser.parse`) and for
a text that grows while it streams (:meth:`ToolParser.parse_partial`, driven by a
:class:`ToolCallStream`); the two must agree: whatever the chunks, what a stream emits adds
up to what ``parse`` finds in the whole text.

A parser also says how to *force* calls (``tool_choice`` ``required`` or a named
function): :meth:`ToolParser.structural_tag` is a structured-output constraint under which
the output is one or more calls in the family's format, each one's arguments an instance of
its function's ``parameters``.

Nothing here imports torch.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Sequence


@dataclass(frozen=True)
class Tool:
    """A function the request declares (OpenAI's ``tools[i].function``; Anthropic's tool)."""

    name: str
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})
    description: str | None = None


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's ``name``, its ``arguments`` as the text of a JSON object, and
    the id the format gives it (None when it gives none; the server then makes one).

    In a partial parse the name is ``""`` until it is known, and ``arguments`` is the part
    of the arguments text that can no longer change."""

    name: str
    arguments: str
    id: str | None = None


@dataclass(frozen=True)
class ParsedToolCalls:
    """An output split into ``content`` (every text that is not part of a call, in order) and
    its calls."""

    content: str
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True)
class ToolCallDelta:
    """What a stream adds to call ``index``: its id and name the first time (with
    OpenAI, the chunk that opens a call carries both), then fragments of its arguments."""

    index: int
    name: str | None = None
    id: str | None = None
    arguments: str = ""


@dataclass(frozen=True)
class ToolStreamDelta:
    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


class ToolParser(ABC):
    """A model family's tool-call format. Built once per request as ``cls(tools)``.

    ``markers``: the strings any call begins with. Until one appears, a stream passes text
    straight through as content (holding back a tail that could be the start of one) and
    never calls :meth:`parse_partial`; leave it empty when a call has no such marker (a
    bare JSON object). ``special_tokens``: the format's markers are special tokens, so the
    output must be decoded with them (``skip_special_tokens=False``).
    """

    name: ClassVar[str]
    markers: ClassVar[tuple[str, ...]] = ()
    special_tokens: ClassVar[bool] = False

    def __init__(self, tools: Sequence[Tool] = ()) -> None:
        self.tools = tuple(tools)

    @abstractmethod
    def parse(self, text: str) -> ParsedToolCalls:
        """The content and the calls of a whole output. A call that is not well formed
        (cut short, arguments that are not a JSON object) is content, as written."""

    @abstractmethod
    def parse_partial(self, text: str) -> ParsedToolCalls:
        """What can be said of an output of which ``text`` is the beginning: the content
        that no continuation can turn into part of a call, and the calls begun so far,
        each with its name once the text has all of it (``""`` before) and the leading
        part of its arguments written so far. Each later text's answer extends this one
        (content and arguments only grow), and so does :meth:`parse` of the whole when
        its calls are well formed. A call that turns out malformed (cut short, arguments
        that are not an object) is content in :meth:`parse`; a stream cannot take back
        what it sent of it, so a parser may instead report a call only once it is whole."""

    def structural_tag(self, tools: Sequence[Tool], *, parallel: bool) -> dict | None:
        """A ``structural_tag`` constraint (the engine's format, see
        :class:`~engine.sampling_params.StructuredOutputsParams`) under which the output
        starts with a call of one of ``tools`` whose arguments are an instance of its
        ``parameters``; one call and nothing after it unless ``parallel``. None when the
        format cannot be forced this way (``tool_choice`` ``required`` is then refused)."""
        return None

    def new_call_id(self, prefix: str) -> str:
        """An id for a call the format gives none (OpenAI's ``call_...``, Anthropic's
        ``toolu_...`` with their ``prefix``). A family whose chat template checks the ids it
        is sent back (Mistral's: nine letters and digits) makes its own."""
        return f"{prefix}{uuid.uuid4().hex[:24]}"

    def streamer(self) -> ToolCallStream:
        return ToolCallStream(self)


class ToolCallStream:
    """Incremental parsing of one output: :meth:`feed` each new piece of text, then
    :meth:`finish`; each returns what became certain since the last call."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self._inside = not parser.markers  # a marker has been seen (or there are none)
        self._content = 0  # characters of content sent
        self._calls: list[list[Any]] = []  # per call sent: [name, id, arguments sent]

    def feed(self, delta: str) -> ToolStreamDelta:
        self.text += delta
        if not self._inside:
            start = max(0, self._content - max(map(len, self.parser.markers)))
            if any(marker in self.text[start:] for marker in self.parser.markers):
                self._inside = True
            else:
                end = len(self.text) - held_back(self.text, self.parser.markers)
                content = self.text[self._content : end]
                self._content = max(self._content, end)
                return ToolStreamDelta(content)
        return self._diff(self.parser.parse_partial(self.text))

    def finish(self) -> ToolStreamDelta:
        return self._diff(self.parser.parse(self.text))

    def _diff(self, parsed: ParsedToolCalls) -> ToolStreamDelta:
        content = parsed.content[self._content :]
        self._content = max(self._content, len(parsed.content))
        deltas = []
        sent = iter(range(len(self._calls)))  # the calls sent, in order, matched to the parsed ones
        index = next(sent, None)
        for call in parsed.tool_calls:
            if not call.name:
                break  # calls open in order: nothing after a call whose name is not known yet
            # a sent call the parse no longer holds turned out malformed: it stays sent, unfinished,
            # and the parsed call is matched with the next one
            while index is not None and not self._continues(index, call):
                index = next(sent, None)
            if index is None:
                self._calls.append([call.name, call.id, call.arguments])
                deltas.append(ToolCallDelta(len(self._calls) - 1, call.name, call.id, call.arguments))
                continue
            known = self._calls[index]
            if len(call.arguments) > len(known[2]):
                deltas.append(ToolCallDelta(index, arguments=call.arguments[len(known[2]) :]))
                known[2] = call.arguments
            index = next(sent, None)
        return ToolStreamDelta(content, tuple(deltas))

    def _continues(self, index: int, call: ToolCall) -> bool:
        name, id_, arguments = self._calls[index]
        return call.name == name and call.id == id_ and call.arguments.startswith(arguments)


def held_back(text: str, markers: Sequence[str]) -> int:
    """The length of the longest tail of ``text`` that begins one of ``markers``."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return longest


def scan_json(text: str, start: int) -> int | None:
    """Where the JSON value that begins at ``text[start]`` (after any whitespace) ends: the
    index after its last character, or None when the text ends first. Objects, arrays and
    strings are matched by their brackets and quotes; other values end at the next
    delimiter. The value itself is not validated (``json.loads`` does that)."""
    i, n = start, len(text)
    while i < n and text[i] in " \t\r\n":
        i += 1
    if i >= n:
        return None
    depth, in_string, escaped = 0, False, False
    if text[i] not in '{["':
        while i < n and text[i] not in ",}] \t\r\n":
            i += 1
        return i if i < n else None
    for j in range(i, n):
        ch = text[j]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if depth == 0:
                    return j + 1
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
    return None
