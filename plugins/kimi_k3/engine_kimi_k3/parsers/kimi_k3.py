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
model's own, so the parser writes them (``json.dumps``, keys in the model's order, non-ASCII
as is); a call carries no id (``index`` counts the calls of a message from 1), so the server
makes one.

Calls cannot be forced with the engine's structural tags: a structure holds one JSON
instance, and K3's arguments are a sequence of typed tags (:meth:`structural_tag` is None).
"""

from __future__ import annotations

import json
import re

from engine.interfaces.tool_parser import ToolCall
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
        attributes = read_attributes(head) if found else None
        if not attributes or not attributes.get("tool"):
            return None
        arguments: dict = {}
        i = 0
        while True:
            while i < len(rest) and rest[i].isspace():
                i += 1
            if i == len(rest):
                break
            if not rest.startswith(ARGUMENT_OPEN, i):
                return None
            head_end = rest.find(SEP, i)
            value_end = rest.find(ARGUMENT_CLOSE, i)
            if head_end < 0 or value_end < head_end:
                return None
            tag = read_attributes(rest[i + len(ARGUMENT_OPEN) : head_end])
            if not tag or "key" not in tag:
                return None
            raw = rest[head_end + len(SEP) : value_end]
            if tag.get("type", "string") == "string":
                arguments[tag["key"]] = raw
            else:
                try:
                    arguments[tag["key"]] = json.loads(raw)
                except ValueError:
                    return None
            i = value_end + len(ARGUMENT_CLOSE)
        return ToolCall(attributes["tool"], json.dumps(arguments, ensure_ascii=False))
