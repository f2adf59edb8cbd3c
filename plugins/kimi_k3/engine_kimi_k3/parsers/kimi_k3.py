"""Kimi K3's tool calls (``kimi_k3``): the XTML ``tools`` channel after the ``response`` one::

    <|open|>response<|sep|>On it.<|close|>response<|sep|>
    <|open|>tools<|sep|>
      <|open|>call tool="get_weather" index="1"<|sep|>
        <|open|>argument key="city" type="string"<|sep|>Beijing<|close|>argument<|sep|>
        <|open|>argument key="days" type="number"<|sep|>2<|close|>argument<|sep|>
      <|close|>call<|sep|>
    <|close|>tools<|sep|>
    <|close|>message<|sep|>

Content is the ``response`` channel's text, its markers (and ``<|close|>message<|sep|>``)
dropped; the prompt may already have opened it. Each argument is tagged with its JSON type:
a ``string`` is its raw text, any other type is the JSON text of its value. Attribute values
escape ``&`` and ``"`` as ``&amp;`` and ``&quot;``. The arguments are no JSON text of the
model's own, so the parser writes them as ``json.dumps`` writes the object (keys in the model's
order, non-ASCII as is): ``{"city": "Beijing", "days": 2}``, one member per argument tag, in
order (a key the call repeats is written again, and JSON readers keep its last value); a call
carries no id (``index`` counts the calls of a message from 1), so the server makes one.

A stream opens a call once its ``call`` tag is complete, with ``{``, and then sends its arguments
text as the arguments are written, each partial answer a prefix of that final text: a
``string`` argument's ``"key": "`` once its tag is complete (after ``", "`` when it is not the
first), then its value as it grows, less a tail that could begin ``<|close|>argument<|sep|>``,
escaped as ``json.dumps`` escapes it (each character on its own, so the escaped text of a value's
beginning is the beginning of the escaped whole: ``{"city": "Bei`` grows into ``{"city":
"Beijing"``), its closing quote when the argument closes. Any other type is sent whole, key and
value, when its argument closes: the arguments hold its value re-encoded (``[3,4]`` as ``[3,
4]``), which is known only once the value is. The closing ``}`` comes with the call's end.
Nothing is sent of an argument that breaks the call (a value that is not JSON, a malformed tag,
stray text), nor after it.

Calls cannot be forced with the engine's structural tags: a structure holds one JSON
instance, and K3's arguments are a sequence of typed tags (:meth:`structural_tag` is None).
"""

from __future__ import annotations

import json
import re

from engine.interfaces.tool_parser import ToolCall, held_back
from engine_kimi_k3.parsers.sections import SectionToolParser
from engine_kimi_k3.parsers.xtml import (
    ANSWER_MARKERS,
    ARGUMENT_CLOSE,
    ARGUMENT_OPEN,
    CALL_CLOSE,
    CALL_OPEN,
    SEP,
    TOOLS_CLOSE,
    TOOLS_OPEN,
)

_ATTRIBUTES = re.compile(r'(?:\s+(\w+)="([^"]*)")*\s*')
_ATTRIBUTE = re.compile(r'(\w+)="([^"]*)"')


def read_attributes(text: str) -> dict[str, str] | None:
    """``key="value"`` pairs, each after whitespace; None when ``text`` is anything else."""
    if not _ATTRIBUTES.fullmatch(text):
        return None
    return {key: value.replace("&quot;", '"').replace("&amp;", "&") for key, value in _ATTRIBUTE.findall(text)}


class KimiK3ToolParser(SectionToolParser):
    name = "kimi_k3"
    markers = (TOOLS_OPEN, *ANSWER_MARKERS)
    special_tokens = True
    section_begins = (TOOLS_OPEN,)
    section_ends = (TOOLS_CLOSE,)
    call_begin = CALL_OPEN
    call_end = CALL_CLOSE
    outside_markers = ANSWER_MARKERS

    def read_call(self, body: str) -> ToolCall | None:
        head, found, rest = body.partition(SEP)
        tool = _tool(head) if found else None
        arguments = _arguments(rest) if tool else None
        return ToolCall(tool, arguments) if tool and arguments is not None else None

    def read_partial_call(self, body: str) -> ToolCall | None:
        head, found, rest = body.partition(SEP)
        tool = _tool(head) if found else None
        return ToolCall(tool, _arguments(rest, self.stops)) if tool else None


def _tool(head: str) -> str | None:
    """The tool a call tag's attributes name, or None."""
    attributes = read_attributes(head)
    return attributes.get("tool") or None if attributes else None


def _dumps(value: object) -> str:
    return json.dumps(value, ensure_ascii=False)


def _arguments(rest: str, stops: tuple[str, ...] | None = None) -> str | None:
    """The arguments text of a call whose body after its tag is ``rest``: whole (None when
    ``rest`` is anything but argument tags and whitespace), or, with ``stops`` (the markers
    that end a call's body), the leading part of it that ``rest``, a call in progress, has for
    certain (up to the first thing that makes the call malformed)."""
    partial = stops is not None
    fields: list[str] = []
    i = 0
    while True:
        while i < len(rest) and rest[i].isspace():
            i += 1
        if i == len(rest):
            break
        if not rest.startswith(ARGUMENT_OPEN, i):
            return "{" + ", ".join(fields) if partial else None
        head_end = rest.find(SEP, i)
        value_end = rest.find(ARGUMENT_CLOSE, i)
        if partial and head_end >= 0 and value_end < 0:  # an argument in progress
            tag = read_attributes(rest[i + len(ARGUMENT_OPEN) : head_end])
            if tag and "key" in tag and tag.get("type", "string") == "string":
                raw = rest[head_end + len(SEP) :]
                raw = raw[: len(raw) - held_back(raw, (ARGUMENT_CLOSE, *stops))]
                fields.append(f"{_dumps(tag['key'])}: {_dumps(raw)[:-1]}")
            break
        if head_end < 0 or value_end < head_end:
            return "{" + ", ".join(fields) if partial else None
        tag = read_attributes(rest[i + len(ARGUMENT_OPEN) : head_end])
        if not tag or "key" not in tag:
            return "{" + ", ".join(fields) if partial else None
        raw = rest[head_end + len(SEP) : value_end]
        if tag.get("type", "string") == "string":
            value = raw
        else:
            try:
                value = json.loads(raw)
            except ValueError:
                return "{" + ", ".join(fields) if partial else None
        fields.append(f"{_dumps(tag['key'])}: {_dumps(value)}")
        i = value_end + len(ARGUMENT_CLOSE)
    return "{" + ", ".join(fields) + ("" if partial else "}")
