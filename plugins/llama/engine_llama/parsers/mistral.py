"""Mistral tool calls, in the forms mistral_common's instruct tokenizers write them.

Every form opens with the control token ``[TOOL_CALLS]``:

- tokenizers before v11 (``InstructTokenizerV2``/``V3``/``V7``: Mistral 7B v0.3, Nemo,
  Small 2409 and 2501, Large 2407): ``[TOOL_CALLS]`` and one JSON list of the calls,
  ``[{"name": "...", "arguments": {...}}]``, each with an ``"id"`` from v3 on when the
  call has one (SentencePiece tokenizers decode a space before the list);
- v11: one group per call, ``[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}``, the id optional;
- v13: ``[TOOL_CALLS]name[ARGS]{...}``.

From v7 on, text may come before the calls; that is the content. A group (from one
``[TOOL_CALLS]`` to the next, or to the end) holds calls and whitespace only; any other
group is content, as written. The format has no closing token, so a group is certain only
once the next ``[TOOL_CALLS]`` begins, and the last one when the output ends.
"""

from __future__ import annotations

import json
import re
from typing import Sequence

from engine.interfaces.tool_parser import ParsedToolCalls, Tool, ToolCall, ToolParser, scan_json
from engine_llama.parsers.json_text import (
    WHITESPACE,
    call_from_object,
    held_back,
    object_members,
    skip_whitespace,
)

TOOL_CALLS, CALL_ID, ARGS = "[TOOL_CALLS]", "[CALL_ID]", "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")  # OpenAI's function names (with dots)


class MistralToolParser(ToolParser):
    name = "mistral"
    markers = (TOOL_CALLS,)
    special_tokens = True

    def parse(self, text: str) -> ParsedToolCalls:
        return self._read(text, final=True)

    def parse_partial(self, text: str) -> ParsedToolCalls:
        return self._read(text, final=False)

    def structural_tag(self, tools: Sequence[Tool], *, parallel: bool) -> dict | None:
        # The list form: what the pre-v11 tokenizers of most MistralForCausalLM checkpoints
        # write. Parallel calls repeat the group, which the parser reads as one sequence.
        structures = [
            {
                "begin": f'{TOOL_CALLS}[{{"name": {json.dumps(tool.name)}, "arguments": ',
                "schema": tool.parameters,
                "end": "}]",
            }
            for tool in tools
        ]
        return {
            "structures": structures,
            "triggers": [TOOL_CALLS],
            "at_least_one": True,
            "stop_after_first": not parallel,
        }

    def _read(self, text: str, final: bool) -> ParsedToolCalls:
        first = text.find(TOOL_CALLS)
        if first < 0:
            end = len(text) if final else len(text) - held_back(text, TOOL_CALLS)
            return ParsedToolCalls(text[:end])
        content, calls = [text[:first]], []
        start = first
        while start < len(text):
            group = _group(text, start, final)
            if group is None:
                break  # only what follows can tell
            read, end = group
            if read is None:
                content.append(text[start:end])
            else:
                calls += read
            start = end
        return ParsedToolCalls("".join(content), tuple(calls))


def _group(text: str, start: int, final: bool) -> tuple[list[ToolCall] | None, int] | None:
    """The group that opens with the ``[TOOL_CALLS]`` at ``text[start]``: its calls (None:
    it is malformed) and where it ends; None when only a continuation can tell (never when
    ``final``)."""
    i = skip_whitespace(text, start + len(TOOL_CALLS))
    if text[i : i + 1] == "[":  # the list form
        opener, end = "[", scan_json(text, i)
        calls = _call_list(text[i:end]) if end is not None else None
    else:  # name[CALL_ID]id[ARGS]{...}
        args, next_group = text.find(ARGS, i), text.find(TOOL_CALLS, i)
        if args < 0 and next_group < 0:
            return (None, len(text)) if final else None
        if args < 0 or 0 <= next_group < args:
            return None, next_group
        name, _, call_id = text[i:args].partition(CALL_ID)
        name, call_id = name.strip(WHITESPACE), call_id.strip(WHITESPACE)
        if not _NAME.fullmatch(name) or (CALL_ID in text[i:args] and not call_id):
            return _malformed(text, start, final)
        i = skip_whitespace(text, args + len(ARGS))
        if i == len(text) and not final:
            return None
        opener, end = "{", scan_json(text, i) if text[i : i + 1] == "{" else None
        is_object = end is not None and object_members(text[i:end]) is not None
        calls = [ToolCall(name, text[i:end], call_id or None)] if is_object else None
    if end is None:  # the JSON has not closed (yet), or it does not open
        return None if text[i : i + 1] == opener and not final else _malformed(text, start, final)
    if calls is None:
        return _malformed(text, start, final)
    k = skip_whitespace(text, end)
    if text.startswith(TOOL_CALLS, k) or (k == len(text) and final):
        return calls, k
    if not final and TOOL_CALLS.startswith(text[k:]):
        return None
    return _malformed(text, start, final)


def _malformed(text: str, start: int, final: bool) -> tuple[None, int] | None:
    """A malformed group runs to the next ``[TOOL_CALLS]`` or the end of the output."""
    next_group = text.find(TOOL_CALLS, start + len(TOOL_CALLS))
    if next_group >= 0:
        return None, next_group
    return (None, len(text)) if final else None


def _call_list(text: str) -> list[ToolCall] | None:
    """The calls of the JSON list ``text``; None when it is anything else."""
    calls: list[ToolCall] = []
    i = skip_whitespace(text, 1)
    while i < len(text) and text[i] == "{":
        end = scan_json(text, i)
        call = call_from_object(text[i:end], ("arguments",), id_key="id") if end is not None else None
        if call is None:
            return None
        calls.append(call)
        i = skip_whitespace(text, end)
        if text[i : i + 1] != ",":
            break
        i = skip_whitespace(text, i + 1)
    return calls if calls and text[i:] == "]" else None
