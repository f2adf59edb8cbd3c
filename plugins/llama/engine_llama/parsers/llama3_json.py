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

A stream does not wait for the end: while the output so far is calls (after whitespace
and ``<|python_tag|>``), the last one perhaps unfinished, it opens each call once its
``"name"`` value is complete and sends its arguments object as it is written. Output
that does not begin as a call (prose first) streams as content from the start. When prose
follows calls the stream has opened, or a call turns out malformed, the output is
content after all: the stream cannot take back the calls it opened, and goes on to send
the whole output as content, the calls' text included.
"""

from __future__ import annotations

from typing import Sequence

from engine.interfaces.tool_parser import ParsedToolCalls, Tool, ToolCall, ToolParser, scan_json
from engine_llama.parsers.json_text import call_from_object, call_so_far, call_structures, skip_whitespace

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = ";"
ARGUMENTS = ("parameters", "arguments")  # the template's key, and the one vLLM accepts too


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    markers = ()  # a call is a bare JSON object

    def parse(self, text: str) -> ParsedToolCalls:
        calls = self._read(text, final=True)
        return ParsedToolCalls("", calls) if calls else ParsedToolCalls(text)

    def parse_partial(self, text: str) -> ParsedToolCalls:
        calls = self._read(text, final=False)
        return ParsedToolCalls(text) if calls is None else ParsedToolCalls("", calls)

    def structural_tag(self, tools: Sequence[Tool], *, parallel: bool) -> dict | None:
        """One forced call, even when parallel calls are allowed: the format's calls must be the
        whole output, and a structural tag cannot keep the text after a call to ``; ``
        followed by another call."""
        return {
            "structures": call_structures(tools, "", "", arguments_key="parameters"),
            "triggers": ['{"name": '],
            "at_least_one": True,
            "stop_after_first": True,
        }

    def _read(self, text: str, final: bool) -> tuple[ToolCall, ...] | None:
        """The calls that make up the whole of ``text``; None when it is not calls only.
        A partial read (not ``final``) answers, while the text may still become calls only,
        the calls begun so far: the whole ones, and an unfinished last one once its name is
        complete, as far as it is written."""
        i = skip_whitespace(text, 0)
        if text.startswith(PYTHON_TAG, i):
            i = skip_whitespace(text, i + len(PYTHON_TAG))
        elif not final and i < len(text) and PYTHON_TAG.startswith(text[i:]):
            return ()
        calls: list[ToolCall] = []
        while True:
            if i == len(text):
                return None if final else tuple(calls)
            if text[i] != "{":
                return None
            end = scan_json(text, i)
            if end is None:
                if final:
                    return None
                call = call_so_far(text[i:], ARGUMENTS)
                return (*calls, call) if call is not None else tuple(calls)
            call = call_from_object(text[i:end], ARGUMENTS)
            if call is None:
                return None
            calls.append(call)
            k = skip_whitespace(text, end)
            if k == len(text):
                return tuple(calls)
            if text[k] != SEPARATOR:
                return None
            i = skip_whitespace(text, k + 1)
