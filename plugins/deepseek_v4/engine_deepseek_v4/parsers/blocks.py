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

A stream reports a call as it is written (:meth:`BlockToolParser.read_partial_call`): once its
name is complete, with the leading part of its arguments that no continuation of a well-formed
call can change. So :meth:`BlockToolParser.parse_partial` reports the complete calls, then the
call in progress, and content up to the first thing not yet decided (a call in progress, a tail
that could begin a block). A call in progress that turns out malformed (cut short, arguments
that do not decode) is content in :meth:`parse`; a stream has opened it and cannot take it back,
but what it sends as content still adds up to the text.
"""

from __future__ import annotations

import json
from abc import abstractmethod
from typing import Any, ClassVar, Sequence

from engine.interfaces.tool_parser import ParsedToolCalls, ToolCall, ToolParser, held_back, scan_json

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

    def read_partial_call(self, body: str) -> ToolCall | None:
        """The call a body begins (``body`` is all the text after ``call_begin``, no end
        marker in it yet), as far as it is certain: its name once complete, with the leading
        part of its arguments that the call, if it turns out well formed, has in
        :meth:`read_call`; None while the name is not complete (or cannot be valid)."""
        return None

    @property
    def stops(self) -> tuple[str, ...]:
        """The markers that end a call's body."""
        return (self.call_end, self.call_begin, self.block_end)

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
                    tail = tail[: len(tail) - held_back(tail, self.markers)]
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
                if text.startswith(self.call_begin, stop):  # a call in progress
                    call = self.read_partial_call(text[stop + len(self.call_begin) :])
                    if call is not None:
                        calls.append(call)
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
            end, marker = find_first(text, self.stops, body)
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


def json_so_far(text: str, stops: Sequence[str], fence: str = "") -> str:
    """The leading part of a call's JSON arguments that ``text``, what the call has written of
    them so far (up to the end of the output, no end marker in it), has for certain, the
    whitespace around them not being part of them: once the JSON value has closed
    (:func:`~engine.interfaces.tool_parser.scan_json`), all of it; before, all but a tail that
    could begin what closes the arguments (whitespace, the characters of ``fence``, the
    beginning of one of ``stops``), so that no character of a closing fence or end marker
    is ever part of them."""
    text = text.lstrip()
    end = scan_json(text, 0)
    if end is not None:
        return text[:end]
    text = text[: len(text) - held_back(text, stops)]
    return text.rstrip(" \t\r\n" + fence)


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
