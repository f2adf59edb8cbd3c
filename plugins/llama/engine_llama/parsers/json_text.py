"""JSON read as text: an object's members with each value's text as the model wrote it, the
call a ``{"name": ..., "<arguments key>": {...}}`` object makes (whole, or as far as it is
written), and what the formats that write such objects after a marker share."""

from __future__ import annotations

import json
from abc import abstractmethod
from typing import Any, ClassVar, Sequence

from engine.interfaces.tool_parser import ParsedToolCalls, Tool, ToolCall, ToolParser, scan_json

WHITESPACE = " \t\r\n"  # JSON's whitespace
_DECODER = json.JSONDecoder()


def skip_whitespace(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def object_members(text: str) -> dict[str, tuple[Any, str]] | None:
    """The members of the one JSON object ``text`` holds (whitespace around it allowed):
    ``key -> (value, the value's text as written)``; a repeated key keeps its last value,
    as ``json.loads`` does. None when ``text`` is anything else."""
    members: dict[str, tuple[Any, str]] = {}
    try:
        i = skip_whitespace(text, 0)
        if text[i] != "{":
            return None
        i = skip_whitespace(text, i + 1)
        if text[i] == "}":
            i += 1
        else:
            while True:
                key, i = _DECODER.raw_decode(text, i)
                i = skip_whitespace(text, i)
                if not isinstance(key, str) or text[i] != ":":
                    return None
                start = skip_whitespace(text, i + 1)
                value, i = _DECODER.raw_decode(text, start)
                members[key] = (value, text[start:i])
                i = skip_whitespace(text, i)
                if text[i] == "}":
                    i += 1
                    break
                if text[i] != ",":
                    return None
                i = skip_whitespace(text, i + 1)
    except (json.JSONDecodeError, IndexError):
        return None
    return members if skip_whitespace(text, i) == len(text) else None


def call_from_object(text: str, arguments_keys: Sequence[str], id_key: str | None = None) -> ToolCall | None:
    """The call the JSON object ``text`` makes: a non-empty string ``name`` and, under
    exactly one of ``arguments_keys``, an object (kept as written); ``id_key``, when given
    and present, must be a string. None when ``text`` is no such object."""
    members = object_members(text)
    if members is None:
        return None
    name = members.get("name", (None, ""))[0]
    given = [key for key in arguments_keys if key in members]
    if not isinstance(name, str) or not name or len(given) != 1:
        return None
    arguments, arguments_text = members[given[0]]
    if not isinstance(arguments, dict):
        return None
    call_id = None
    if id_key is not None and id_key in members:
        call_id = members[id_key][0]
        if not isinstance(call_id, str):
            return None
    return ToolCall(name, arguments_text, call_id)


def call_so_far(
    text: str, arguments_keys: Sequence[str], id_key: str | None = None, *, wait_for_id: bool = False
) -> ToolCall | None:
    """The call begun by ``text``, the beginning of a JSON object that :func:`call_from_object`
    may read once it is whole: its name once the ``"name"`` value is complete (in whatever
    place among the members), and the part of its arguments object written so far (inside
    the value only: never a character after it). With ``id_key``, the id once complete;
    ``wait_for_id``: no call until it is (the call's id must come with its name).

    None while the name is not complete, and when what is written can no longer begin such
    a call (a member that is not of the right type, both arguments keys, a key given twice:
    whole, ``json.loads`` would keep its last value, which a stream has not followed)."""
    name = call_id = arguments = None
    seen: set[str] = set()
    i = skip_whitespace(text, 0)
    if text[i : i + 1] != "{":
        return None
    i = skip_whitespace(text, i + 1)
    closed = text[i : i + 1] == "}"  # the empty object
    while i < len(text) and not closed:
        if text[i] != '"':
            return None
        key_end = scan_json(text, i)
        if key_end is None:
            break
        key = _decoded(text[i:key_end])
        j = skip_whitespace(text, key_end)
        if not isinstance(key, str) or key in seen or text[j : j + 1] not in (":", ""):
            return None
        seen.add(key)
        start = skip_whitespace(text, j + 1)
        if start >= len(text):
            break
        expected = '"' if key in ("name", id_key) else "{" if key in arguments_keys else None
        if expected is not None and text[start] != expected:
            return None
        end = scan_json(text, start)
        if key in arguments_keys:
            if arguments is not None:
                return None  # both keys
            arguments = text[start:end]
        if end is None:
            break
        value = _decoded(text[start:end])
        if key in arguments_keys and not isinstance(value, dict):
            return None
        if key == "name":
            if not isinstance(value, str) or not value:
                return None
            name = value
        elif key == id_key:
            if not isinstance(value, str):
                return None
            call_id = value
        i = skip_whitespace(text, end)
        if text[i : i + 1] == "}":
            closed = True
        elif text[i : i + 1] == ",":
            i = skip_whitespace(text, i + 1)
        elif i < len(text):
            return None
    if name is None or (wait_for_id and call_id is None and not closed):
        return None
    return ToolCall(name, arguments or "", call_id)


def _decoded(text: str) -> Any:
    """The JSON value ``text`` holds; a sentinel no member may have when it is not JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return _NOT_JSON


_NOT_JSON = object()


def call_structures(tools: Sequence[Tool], before: str, after: str, arguments_key: str = "arguments") -> list[dict]:
    """One ``structural_tag`` structure per tool: ``before``, ``{"name": <its name>,
    "<arguments_key>": ``, its arguments (an instance of its ``parameters``), ``}`` and
    ``after``."""
    return [
        {
            "begin": f'{before}{{"name": {json.dumps(tool.name)}, {json.dumps(arguments_key)}: ',
            "schema": tool.parameters,
            "end": "}" + after,
        }
        for tool in tools
    ]


class MarkedJsonToolParser(ToolParser):
    """A format whose calls are JSON ``{"name": ..., "arguments": {...}}`` objects after its
    marker (``markers[0]``). One reading (:meth:`read`) serves the whole text (``final``)
    and the beginning of one; calls are forced as ``call_before`` + object + ``call_after``."""

    call_before: ClassVar[str]
    call_after: ClassVar[str]

    def parse(self, text: str) -> ParsedToolCalls:
        return self.read(text, final=True)

    def parse_partial(self, text: str) -> ParsedToolCalls:
        return self.read(text, final=False)

    @abstractmethod
    def read(self, text: str, final: bool) -> ParsedToolCalls:
        """``parse`` when ``final``, else ``parse_partial``."""

    def structural_tag(self, tools: Sequence[Tool], *, parallel: bool) -> dict | None:
        return {
            "structures": call_structures(tools, self.call_before, self.call_after),
            "triggers": [self.markers[0]],
            "at_least_one": True,
            "stop_after_first": not parallel,
        }
