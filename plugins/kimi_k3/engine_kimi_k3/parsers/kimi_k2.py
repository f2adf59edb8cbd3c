"""Kimi K2's tool calls (``kimi_k2``), also Kimi K2.5, K2.6 and Kimi Linear's.

As Moonshot's chat template writes them and its tool-call guide reads them::

    <|tool_calls_section_begin|>
    <|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Beijing"}<|tool_call_end|>
    <|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>
    <|tool_calls_section_end|>

The call's id is ``functions.NAME:IDX``, the counter of the call in the conversation, and it
is kept as the call's id (the template writes it back as ``tool_call['id']`` and tool results
as ``## Return of ID``). Some checkpoints write the section markers in the singular
(``<|tool_call_section_begin|>``); an id without the ``functions.`` prefix also reads. The
guide's reader allows whitespace around the id and the arguments; it is not part of them.

A stream opens a call, with its name and id, at ``<|tool_call_argument_begin|>``, then sends
its arguments as the model writes them: the JSON text so far, less a tail that could begin the
call's end marker, all of it once the JSON value has closed. Whole, a call's arguments are
exactly what the stream sent of them.
"""

from __future__ import annotations

import json
import re
from typing import Sequence

from engine.interfaces.tool_parser import Tool, ToolCall
from engine_kimi_k3.parsers.sections import SectionToolParser, json_so_far

SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
SECTION_BEGINS = (SECTION_BEGIN, "<|tool_call_section_begin|>")
SECTION_ENDS = (SECTION_END, "<|tool_call_section_end|>")
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"

_CALL_ID = re.compile(r"(?:functions\.)?(?P<name>\S+?):(?P<index>\d+)")


class KimiK2ToolParser(SectionToolParser):
    name = "kimi_k2"
    markers = SECTION_BEGINS
    special_tokens = True
    section_begins = SECTION_BEGINS
    section_ends = SECTION_ENDS
    call_begin = CALL_BEGIN
    call_end = CALL_END

    def read_call(self, body: str) -> ToolCall | None:
        header, found, arguments = body.partition(ARGUMENT_BEGIN)
        call_id = header.strip()
        match = _CALL_ID.fullmatch(call_id)
        if not found or match is None:
            return None
        arguments = arguments.strip()
        try:
            value = json.loads(arguments)
        except ValueError:
            return None
        return ToolCall(match["name"], arguments, call_id) if isinstance(value, dict) else None

    def read_partial_call(self, body: str) -> ToolCall | None:
        header, found, arguments = body.partition(ARGUMENT_BEGIN)
        call_id = header.strip()
        match = _CALL_ID.fullmatch(call_id)
        if not found or match is None:
            return None
        return ToolCall(match["name"], json_so_far(arguments, self.stops), call_id)

    def structural_tag(self, tools: Sequence[Tool], *, parallel: bool) -> dict | None:
        """Each forced call is a section of its own whose id is ``functions.NAME:0``: a
        structure's begin is a fixed text, so it cannot count the calls. Two forced calls
        of one function therefore share an id."""
        structures = [
            {
                "begin": f"{SECTION_BEGIN}{CALL_BEGIN}functions.{tool.name}:0{ARGUMENT_BEGIN}",
                "schema": tool.parameters,
                "end": f"{CALL_END}{SECTION_END}",
            }
            for tool in tools
        ]
        return {
            "structures": structures,
            "triggers": [SECTION_BEGIN],
            "at_least_one": True,
            "stop_after_first": not parallel,
        }
