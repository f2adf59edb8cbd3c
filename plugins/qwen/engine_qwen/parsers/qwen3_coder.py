"""Qwen3-Coder's and Qwen3.5's XML tool calls, as their chat templates ask for them.

The templates tell the model to write each call as::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

one block per call, and write an assistant's earlier calls back the same way: a string
argument as it is, any other value as JSON. So a parameter's text is the value: a string
where the function's ``parameters`` schema says ``string`` (one newline either side is the
format's), else the JSON it reads as (a text that is not JSON stays a string). The
arguments are a JSON object of the parameters in the order written.

The content is the text outside the blocks, except whitespace that only separates a call
from the next call or from the end of the output. A block that is not one function with
only parameters inside (cut short, text between the tags, another opening tag first) is
content, up to its closing tag or the next opening one. A stream reports a call once its
``</tool_call>`` is written (the interface allows a parser to report calls only whole), and
streams the content around calls as it becomes certain.
"""

from __future__ import annotations

import json
import re
from typing import Any

from engine.interfaces.tool_parser import ParsedToolCalls, ToolCall, ToolParser, held_back

OPEN, CLOSE = "<tool_call>", "</tool_call>"
WHITESPACE = " \t\r\n"
FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.S)
PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"
    markers = (OPEN,)

    def parse(self, text: str) -> ParsedToolCalls:
        return self._read(text, final=True)

    def parse_partial(self, text: str) -> ParsedToolCalls:
        return self._read(text, final=False)

    def _read(self, text: str, final: bool) -> ParsedToolCalls:
        content: list[str] = []
        calls: list[ToolCall] = []
        pos, after_call = 0, False
        while True:
            start = text.find(OPEN, pos)
            if start < 0:
                gap = text[pos:]
                if not final:
                    gap = gap[: len(gap) - held_back(gap, (OPEN,))]
                if not (after_call and not gap.strip(WHITESPACE)):
                    content.append(gap)
                break
            gap, body = text[pos:start], start + len(OPEN)
            close, reopen = text.find(CLOSE, body), text.find(OPEN, body)
            if close < 0 or (0 <= reopen < close):  # cut short, or another block opens first
                if reopen < 0 and not final:  # only what comes next can tell
                    if not (after_call and not gap.strip(WHITESPACE)):
                        content.append(gap)
                    break
                end = reopen if reopen >= 0 else len(text)
                content += [gap, text[start:end]]
                pos, after_call = end, False
                if end == len(text):
                    break
                continue
            end = close + len(CLOSE)
            call = self._call(text[body:close])
            if call is None:  # malformed: content, with the text before it
                content += [gap, text[start:end]]
            else:
                if not (after_call and not gap.strip(WHITESPACE)):  # whitespace after a call is the format's
                    content.append(gap)
                calls.append(call)
            pos, after_call = end, call is not None
        return ParsedToolCalls("".join(content), tuple(calls))

    def _call(self, body: str) -> ToolCall | None:
        """The call a block's body holds, or None when it is not one function of parameters."""
        function = FUNCTION.fullmatch(body)
        if function is None:
            return None
        name, inner = function.group(1).strip(), function.group(2)
        if not name or PARAMETER.sub("", inner).strip(WHITESPACE):
            return None  # text between the parameters, or a parameter cut short
        schema = self._properties(name)
        arguments: dict[str, Any] = {}
        for key, raw in PARAMETER.findall(inner):
            arguments[key.strip()] = value_of(raw, schema.get(key.strip(), {}))
        return ToolCall(name, json.dumps(arguments, ensure_ascii=False))

    def _properties(self, name: str) -> dict[str, Any]:
        for tool in self.tools:
            if tool.name == name:
                return (tool.parameters or {}).get("properties") or {}
        return {}


def value_of(raw: str, schema: dict[str, Any]) -> Any:
    """A parameter's value from its text: the format's newline either side dropped; a string
    where the schema says so, else the JSON it reads as, else the text."""
    text = raw[1:] if raw.startswith("\n") else raw
    text = text[:-1] if text.endswith("\n") else text
    kinds = schema.get("type")
    kinds = set(kinds) if isinstance(kinds, list) else {kinds}
    if "string" in kinds and len(kinds) == 1:
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text
