"""Hermes-style tool calls, as the Qwen2.5 and Qwen3 chat templates ask for them.

The templates' system prompt says: "For each function call, return a json object with
function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>",
and they write an assistant's earlier calls back the same way, one block per call, a
newline between blocks. So an output is text and blocks::

    I'll look both up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Tokyo"}}
    </tool_call>

The content is the text outside the blocks as written, except the whitespace that only
separates a call from the next call or from the end of the output (the template's own
newlines). A block that is not one such object between the two tags (cut short, arguments
that are not an object, another closing tag) is content, up to its closing tag or the next
opening one. A call is certain once its closing tag is seen.

A stream opens a call as soon as its ``"name"`` value is complete (after ``"arguments"``,
when the model writes that first), then sends its arguments object as it is written. A
block that turns out malformed is still content in the end; the stream cannot take back
the call it opened for it.
"""

from __future__ import annotations

from engine.interfaces.tool_parser import ParsedToolCalls, ToolCall, held_back, scan_json
from engine_llama.parsers.json_text import (
    WHITESPACE,
    MarkedJsonToolParser,
    call_from_object,
    call_so_far,
    skip_whitespace,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
ARGUMENTS = ("arguments",)  # the key of the arguments object


class HermesToolParser(MarkedJsonToolParser):
    name = "hermes"
    markers = (OPEN,)
    call_before, call_after = f"{OPEN}\n", f"\n{CLOSE}"

    def read(self, text: str, final: bool) -> ParsedToolCalls:
        content: list[str] = []
        calls: list[ToolCall] = []
        pos, after_call = 0, False
        while True:
            start = text.find(OPEN, pos)
            if start < 0:
                gap, (call, end) = text[pos:], (None, None)
                if not final:
                    gap = gap[: len(gap) - held_back(gap, (OPEN,))]
            else:  # end None: the block's fate depends on what comes next
                gap, (call, end) = text[pos:start], _block(text, start, final)
            if end is not None and call is None:  # malformed: content, as the text before it
                content += [gap, text[start:end]]
            elif not (after_call and not gap.strip(WHITESPACE)):  # whitespace after a call is the format's
                content.append(gap)
            if call is not None:
                calls.append(call)
            if end is None:
                break
            pos, after_call = end, call is not None
        return ParsedToolCalls("".join(content), tuple(calls))


def _block(text: str, start: int, final: bool) -> tuple[ToolCall | None, int | None]:
    """The block that opens at ``text[start]``: its call (None: it is malformed) and where
    it ends. The end is None when only a continuation of the text can tell (never when
    ``final``); the call is then the one the block has begun, as far as it is written."""
    body = start + len(OPEN)
    i = skip_whitespace(text, body)
    if i < len(text) and text[i] == "{":
        end = scan_json(text, i)
        if end is None:  # the object has not closed (yet)
            return _malformed(text, body, final) if final else (call_so_far(text[i:], ARGUMENTS), None)
        k = skip_whitespace(text, end)
        if text.startswith(CLOSE, k):
            return call_from_object(text[i:end], ARGUMENTS), k + len(CLOSE)
        if not final and CLOSE.startswith(text[k:]):
            return call_from_object(text[i:end], ARGUMENTS), None
        return _malformed(text, k, final)
    if i == len(text) and not final:
        return None, None
    return _malformed(text, body, final)


def _malformed(text: str, search_from: int, final: bool) -> tuple[None, int | None]:
    """A malformed block ends with the first closing tag or before the first opening tag
    after ``search_from``, or with the output."""
    close, reopen = text.find(CLOSE, search_from), text.find(OPEN, search_from)
    ends = [p + len(CLOSE) for p in (close,) if p >= 0] + [p for p in (reopen,) if p >= 0]
    if ends:
        return None, min(ends)
    return None, (len(text) if final else None)
