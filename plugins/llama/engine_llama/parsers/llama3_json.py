"""Llama 3.1 / 3.2 / 3.3 JSON tool calls.

The Llama 3.1 chat template (and the 3.2 and 3.3 ones after it) tells the model: "Respond
in the format {"name": function name, "parameters": dictionary of argument name and its
value}. Do not use variables.", and writes an earlier call back as
``{"name": "...", "parameters": ...}`` alone in the assistant turn. With a built-in tool
the template opens the turn with ``<|python_tag|>``. The template takes one call per turn;
several calls separated by ``;`` are read too, as vLLM's ``llama3_json`` parser reads them,
and an ``"arguments"`` key in place of ``"parameters"`` is accepted the same way.

The calls must be the whole output (whitespace and an opening ``<|python_tag|>`` aside):
JSON inside prose, or prose after the calls, is content. So nothing is certain until the
output ends, unless it can no longer be calls only (then it is content as it streams).
"""

from __future__ import annotations

import json
from typing import Sequence

from engine.interfaces.tool_parser import ParsedToolCalls, Tool, ToolCall, ToolParser, scan_json
from engine_llama.parsers.json_text import call_from_object, skip_whitespace

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = ";"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    markers = ()  # a call is a bare JSON object

    def parse(self, text: str) -> ParsedToolCalls:
        calls = self._read(text, final=True)
        return ParsedToolCalls("", calls) if calls else ParsedToolCalls(text)

    def parse_partial(self, text: str) -> ParsedToolCalls:
        calls = self._read(text, final=False)
        return ParsedToolCalls(text) if calls is None else ParsedToolCalls("")

    def structural_tag(self, tools: Sequence[Tool], *, parallel: bool) -> dict | None:
        """One forced call, even when parallel calls are allowed: the format's calls must be the
        whole output, and a structural tag cannot keep the text after a call to ``; ``
        followed by another call."""
        structures = [
            {"begin": f'{{"name": {json.dumps(tool.name)}, "parameters": ', "schema": tool.parameters, "end": "}"}
            for tool in tools
        ]
        return {
            "structures": structures,
            "triggers": ['{"name": '],
            "at_least_one": True,
            "stop_after_first": True,
        }

    def _read(self, text: str, final: bool) -> tuple[ToolCall, ...] | None:
        """The calls that make up the whole of ``text``; None when it is not calls only.
        A partial read (not ``final``) answers ``()`` while the text may still become
        calls only."""
        undecided = None if final else ()
        i = skip_whitespace(text, 0)
        if text.startswith(PYTHON_TAG, i):
            i = skip_whitespace(text, i + len(PYTHON_TAG))
        elif not final and i < len(text) and PYTHON_TAG.startswith(text[i:]):
            return undecided
        calls: list[ToolCall] = []
        while True:
            if i == len(text):
                return undecided
            if text[i] != "{":
                return None
            end = scan_json(text, i)
            if end is None:
                return undecided
            call = call_from_object(text[i:end], ("parameters", "arguments"))
            if call is None:
                return None
            calls.append(call)
            k = skip_whitespace(text, end)
            if k == len(text):
                return tuple(calls) if final else ()
            if text[k] != SEPARATOR:
                return None
            i = skip_whitespace(text, k + 1)
