"""Calls in a block: the reading DeepSeek's tool-call formats share.

Every DeepSeek format writes the answer, then a block (V3 ``<｜tool▁calls▁begin｜>`` …
``<｜tool▁calls▁end｜>``, V3.2 and V4 ``<｜DSML｜function_calls>`` / ``<｜DSML｜tool_calls>`` …)
of calls, each between a call-begin and a call-end marker. A subclass names the markers and
decodes one call's body (:meth:`BlockToolParser.read_call`).

How an output reads:
- Text outside blocks is content, less ``content_break``: the separator the format writes
  between the answer and a block (DSML's blank line), which belongs to the block.
- A call whose body decodes is a call; whitespace between calls belongs to the block.
- A block holding no well-formed call is content, as written, markers included.
- Once a block has a call, anything that breaks it off (a call that does not decode, one that
  another marker or the end of the output cuts short, stray text) ends the reading: from
  there, the rest of the output is content. The block's end marker may be missing.

Calls are reported whole, once their end marker has come: until then a call can still turn
out cut short or malformed, which makes it content, and a stream cannot take back a call it
has opened. So :meth:`BlockToolParser.parse_partial` reports the complete calls, and content
up to the first thing not yet decided (a call in progress, a tail that could begin a block).
"""

from __future__ import annotations

import json
from abc import abstractmethod
from typing import Any, ClassVar, Sequence

from engine.interfaces.tool_parser import ParsedToolCalls, ToolCall, ToolParser

OPEN, CLOSED, BROKEN = "open", "closed", "broken"  # how a block's reading stops


class BlockToolParser(ToolParser):
    block_begin: ClassVar[str]
    block_end: ClassVar[str]
    call_begin: ClassVar[str]
    call_end: ClassVar[str]
    content_break: ClassVar[str] = ""
    special_tokens = True

    @abstractmethod
    def read_call(self, body: str) -> ToolCall | None:
        """The call a body (the text between ``call_begin`` and ``call_end``) writes, or None
        when it is not well formed."""

    def parse(self, text: str) -> ParsedToolCalls:
        return self._read(text, final=True)

    def parse_partial(self, text: str) -> ParsedToolCalls:
        return self._read(text, final=False)

    def _read(self, text: str, final: bool) -> ParsedToolCalls:
        content: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        while True:
            begin = text.find(self.block_begin, pos)
            if begin < 0:
                tail = text[pos:]
                if not final:
                    tail = tail[: len(tail) - partial_tail(tail, self.markers)]
                content.append(tail)
                break
            start = begin
            if self.content_break and text.endswith(self.content_break, pos, begin):
                start = begin - len(self.content_break)
            content.append(text[pos:start])
            found, stop, how = self._read_block(text, begin + len(self.block_begin))
            calls += found
            if how == CLOSED and found:
                pos = stop
                continue
            if how == OPEN and not final:
                break  # the rest is not decided yet
            content.append(text[stop if found else start :])  # broken off, cut short, or no call in it
            break
        return ParsedToolCalls("".join(content), tuple(calls))

    def _read_block(self, text: str, i: int) -> tuple[list[ToolCall], int, str]:
        """The calls of the block whose body starts at ``i``, and how and where the reading
        stops: after the end marker (``CLOSED``), or at the first thing that is not a call,
        which later text could still make one (``OPEN``) or not (``BROKEN``)."""
        calls: list[ToolCall] = []
        while True:
            j = i
            while j < len(text) and text[j].isspace():
                j += 1
            if text.startswith(self.block_end, j):
                return calls, j + len(self.block_end), CLOSED
            if not text.startswith(self.call_begin, j):
                rest = text[j:]
                could_begin = self.block_end.startswith(rest) or self.call_begin.startswith(rest)
                return calls, j, OPEN if could_begin else BROKEN
            body = j + len(self.call_begin)
            end, marker = find_first(text, (self.call_end, self.call_begin, self.block_end), body)
            if marker is None:
                return calls, j, OPEN
            call = self.read_call(text[body:end]) if marker == self.call_end else None
            if call is None:
                return calls, j, BROKEN
            calls.append(call)
            i = end + len(marker)


def find_first(text: str, markers: Sequence[str], pos: int) -> tuple[int, str | None]:
    """The earliest of ``markers`` in ``text`` from ``pos``: its index and itself, or ``(-1, None)``."""
    best, found = -1, None
    for marker in markers:
        index = text.find(marker, pos)
        if index >= 0 and (best < 0 or index < best):
            best, found = index, marker
    return best, found


def partial_tail(text: str, markers: Sequence[str]) -> int:
    """The length of the longest tail of ``text`` that begins one of ``markers``."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return longest


def json_object(text: str) -> Any:
    """The object ``text`` is the JSON of, or None (not JSON, not an object, or NaN and
    Infinity, which JSON does not have)."""
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def json_value(text: str) -> bool:
    """Whether ``text`` is the JSON of one value."""
    try:
        json.loads(text, parse_constant=_no_constant)
    except ValueError:
        return False
    return True


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")
