"""JSON read as text: an object's members with each value's text as the model wrote it, and
the call a ``{"name": ..., "<arguments key>": {...}}`` object makes."""

from __future__ import annotations

import json
from typing import Any, Sequence

from engine.interfaces.tool_parser import ToolCall

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


def held_back(text: str, marker: str) -> int:
    """The length of the longest tail of ``text`` that is a proper beginning of ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0
