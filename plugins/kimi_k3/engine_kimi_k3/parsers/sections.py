"""Calls grouped in a section: the reading Kimi's two tool-call formats share.

Both write an answer, then a section (K2 ``<|tool_calls_section_begin|>``, K3
``<|open|>tools<|sep|>``) of call blocks, each between a call-begin and a call-end marker.
A subclass names the markers and decodes one block's body (:meth:`read_call`).

How an output reads:
- Text outside sections is content (less the ``outside_markers``, which wrap the answer).
- A block whose body decodes is a call. A block that does not decode, or that another marker
  or the end of the text cuts short, is content, as written. So is stray text in a section;
  whitespace between blocks is not.
- A section holding no call is content whole, its markers included. A section's end marker
  may be missing (the output stopped after its last call).

Calls are reported whole, once their end marker has come: until then a call can still turn
out cut short or malformed, which makes it content, and a stream cannot take back a call it
has opened. So :meth:`parse_partial` reports the complete calls, and content up to the
first thing not yet decided (a call in progress, a section with no call so far, a tail that
could begin a marker).
"""

from __future__ import annotations

from abc import abstractmethod
from typing import ClassVar, Sequence

from engine.interfaces.tool_parser import ParsedToolCalls, ToolCall, ToolParser


class SectionToolParser(ToolParser):
    section_begins: ClassVar[tuple[str, ...]]
    section_ends: ClassVar[tuple[str, ...]]
    call_begin: ClassVar[str]
    call_end: ClassVar[str]
    outside_markers: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def read_call(self, body: str) -> ToolCall | None:
        """The call a block's body (between ``call_begin`` and ``call_end``) writes, or None
        when it is not well formed."""

    def parse(self, text: str) -> ParsedToolCalls:
        return self._read(text, final=True)

    def parse_partial(self, text: str) -> ParsedToolCalls:
        return self._read(text, final=False)

    def _outside(self, text: str) -> str:
        for marker in self.outside_markers:
            text = text.replace(marker, "")
        return text

    def _read(self, text: str, final: bool) -> ParsedToolCalls:
        content: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        while True:
            start, begin = find_first(text, self.section_begins, pos)
            if begin is None:
                tail = text[pos:]
                if not final:
                    tail = tail[: len(tail) - partial_tail(tail, self.section_begins + self.outside_markers)]
                content.append(self._outside(tail))
                break
            content.append(self._outside(text[pos:start]))
            found, pieces, end, decided = self._read_section(text, start + len(begin), final)
            calls += found
            if found:
                content += pieces  # the section's markers are structure: it holds a call
            elif decided:
                content.append(text[start:end])  # no call in it: the section is content, as written
            if not decided:
                break  # the rest of the text is still open
            pos = end
        return ParsedToolCalls("".join(content), tuple(calls))

    def _read_section(self, text: str, i: int, final: bool) -> tuple[list[ToolCall], list[str], int, bool]:
        """The calls and the content pieces of the section whose body starts at ``i``, where
        it ends, and whether all of it is decided (False: the text ends inside something
        that later text could still change)."""
        n = len(text)
        calls: list[ToolCall] = []
        pieces: list[str] = []
        stops = (self.call_begin, *self.section_ends)
        while True:
            j = i
            while j < n and text[j].isspace():
                j += 1
            if j == n:
                return calls, pieces, n, final
            _, end = find_first(text, self.section_ends, j, at=True)
            if end is not None:
                return calls, pieces, j + len(end), True
            if text.startswith(self.call_begin, j):
                body = j + len(self.call_begin)
                stop, marker = find_first(text, (self.call_end, *stops), body)
                if marker is None:  # the text ends inside the call
                    if not final:
                        return calls, pieces, j, False
                    pieces.append(text[j:])
                    i = n
                elif marker == self.call_end:
                    call = self.read_call(text[body:stop])
                    if call is None:
                        pieces.append(text[j : stop + len(marker)])
                    else:
                        calls.append(call)
                    i = stop + len(marker)
                else:  # another block or the section's end before this call's end: cut short
                    pieces.append(text[j:stop])
                    i = stop
                continue
            stop, marker = find_first(text, stops, j)
            if marker is None:
                if not final:
                    return calls, pieces, j, False
                pieces.append(text[j:])
                i = n
            else:
                pieces.append(text[j:stop])
                i = stop


def find_first(text: str, markers: Sequence[str], pos: int, *, at: bool = False) -> tuple[int, str | None]:
    """The earliest of ``markers`` in ``text`` from ``pos`` (only at ``pos`` when ``at``):
    its index and itself, or ``(-1, None)``."""
    best, found = -1, None
    for marker in markers:
        index = pos if at and text.startswith(marker, pos) else -1 if at else text.find(marker, pos)
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
