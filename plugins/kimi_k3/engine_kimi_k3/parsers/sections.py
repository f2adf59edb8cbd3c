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

A stream reports a call as it is written (:meth:`SectionToolParser.read_partial_call`): once
its name is complete, with the leading part of its arguments that no continuation of a
well-formed call can change. So :meth:`parse_partial` reports the complete calls, then the call
in progress, and content up to the first thing not yet decided (a call in progress, a section
with no complete call so far, a tail that could begin a marker). A call in progress that turns
out malformed is content in :meth:`parse`; a stream has opened it and cannot take it back (a
later call of the section then comes under its index), but what it sends as content still adds
up to the text.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import ClassVar, Sequence

from engine.interfaces.tool_parser import ParsedToolCalls, ToolCall, ToolParser, held_back, scan_json


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

    def read_partial_call(self, body: str) -> ToolCall | None:
        """The call a block's body begins (``body`` is all the text after ``call_begin``, no
        end marker in it yet), as far as it is certain: its name (and id) once complete,
        with the leading part of its arguments that the call, if it turns out well formed,
        has in :meth:`read_call`; None while the name is not complete (or cannot be valid)."""
        return None

    @property
    def stops(self) -> tuple[str, ...]:
        """The markers that end a block's body."""
        return (self.call_end, self.call_begin, *self.section_ends)

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
                    tail = tail[: len(tail) - held_back(tail, self.section_begins + self.outside_markers)]
                content.append(self._outside(tail))
                break
            content.append(self._outside(text[pos:start]))
            found, pieces, end, decided = self._read_section(text, start + len(begin), final)
            calls += found
            if found:
                content += pieces  # the section's markers are structure: it holds a call
            elif decided:
                content.append(text[start:end])  # no call in it: the section is content, as written
            if not decided:  # the rest of the text is still open
                if text.startswith(self.call_begin, end):  # a call in progress
                    call = self.read_partial_call(text[end + len(self.call_begin) :])
                    if call is not None:
                        calls.append(call)
                break
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
                stop, marker = find_first(text, self.stops, body)
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


def json_so_far(text: str, stops: Sequence[str]) -> str:
    """The leading part of a call's JSON arguments that ``text``, what the call has written of
    them so far (up to the end of the output, no end marker in it), has for certain, the
    whitespace around them not being part of them: once the JSON value has closed
    (:func:`~engine.interfaces.tool_parser.scan_json`), all of it; before, all but a tail that
    could begin what closes the arguments (whitespace, the beginning of one of ``stops``), so
    that no character of an end marker is ever part of them."""
    text = text.lstrip()
    end = scan_json(text, 0)
    if end is not None:
        return text[:end]
    text = text[: len(text) - held_back(text, stops)]
    return text.rstrip(" \t\r\n")
