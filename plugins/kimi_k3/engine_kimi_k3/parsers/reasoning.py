"""Kimi's reasoning: ``kimi`` (``<think>`` … ``</think>``: Kimi K2-Thinking, K2.5, K2.6) and
``kimi_k3`` (K3's XTML ``think`` channel).

K2-Thinking's template ends the prompt with the assistant's header and the model opens
``<think>`` itself; K2.5 and K2.6 write ``<think>`` into the prompt when thinking and
``<think></think>`` when not (``thinking=False``), so the prompt says which. A K2 model may
also go straight from its reasoning to a tool-call section without ``</think>``: the
section's begin ends the reasoning and stays in the content, for the tool parser.

K3 thinks in ``<|open|>think<|sep|>`` … ``<|close|>think<|sep|>`` (the prompt may open it)
and then answers in a ``response`` channel. The content is the answer: the ``response``
channel's markers and ``<|close|>message<|sep|>`` are dropped from it (a ``tools`` channel
stays, for the tool parser).
"""

from __future__ import annotations

from typing import ClassVar

from engine.interfaces.reasoning_parser import ReasoningParser, ReasoningSplit
from engine.interfaces.tool_parser import held_back
from engine_kimi_k3.parsers.kimi_k2 import SECTION_BEGINS
from engine_kimi_k3.parsers.sections import find_first
from engine_kimi_k3.parsers.xtml import ANSWER_MARKERS, THINK_CLOSE, THINK_OPEN


class KimiReasoningParser(ReasoningParser):
    name = "kimi"
    start = "<think>"
    end = "</think>"
    special_tokens = True
    # markers that end the reasoning without ``end`` and begin the content
    content_begins: ClassVar[tuple[str, ...]] = SECTION_BEGINS
    # markers that wrap the answer, dropped from the content
    answer_markers: ClassVar[tuple[str, ...]] = ()

    def split(self, text: str) -> ReasoningSplit:
        reasoning, rest, _ = self._parts(text)
        return ReasoningSplit(reasoning, self._answer(rest))

    def streamer(self) -> KimiReasoningStream:
        return KimiReasoningStream(self)

    def _answer(self, text: str) -> str:
        for marker in self.answer_markers:
            text = text.replace(marker, "")
        return text

    def _parts(self, text: str) -> tuple[str | None, str, bool]:
        """The reasoning (None: none), the text after it, and whether the reasoning ended."""
        body = text
        if not self.starts_in_reasoning():
            stripped = text.lstrip()
            if not stripped.startswith(self.start):
                return None, text, True
            body = stripped[len(self.start) :]
        cut, marker = find_first(body, (self.end, *self.content_begins), 0)
        if marker is None:
            return body, "", False
        return body[:cut], body[cut + len(self.end) if marker == self.end else cut :], True


class KimiK3ReasoningParser(KimiReasoningParser):
    name = "kimi_k3"
    start = THINK_OPEN
    end = THINK_CLOSE
    content_begins = ()
    answer_markers = ANSWER_MARKERS


class KimiReasoningStream:
    """:meth:`KimiReasoningParser.split` incrementally: what :meth:`feed` and :meth:`finish`
    return, ``(reasoning, content)``, is the text that became certain; a tail that could
    still begin a marker is held back."""

    def __init__(self, parser: KimiReasoningParser) -> None:
        self.parser = parser
        self.text = ""
        self._sent = (0, 0)  # characters of reasoning and of content sent

    def feed(self, delta: str) -> tuple[str, str]:
        self.text += delta
        return self._diff(*self._certain())

    def finish(self) -> tuple[str, str]:
        split = self.parser.split(self.text)
        return self._diff(split.reasoning or "", split.content)

    def _certain(self) -> tuple[str, str]:
        parser, text = self.parser, self.text
        if not parser.starts_in_reasoning() and parser.start.startswith(text.lstrip()):
            return "", ""  # the output may yet open with the marker
        reasoning, rest, ended = parser._parts(text)
        if not ended:
            held = held_back(reasoning, (parser.end, *parser.content_begins))
            return reasoning[: len(reasoning) - held], ""
        rest = rest[: len(rest) - held_back(rest, parser.answer_markers)]
        return reasoning or "", parser._answer(rest)

    def _diff(self, reasoning: str, content: str) -> tuple[str, str]:
        sent_reasoning, sent_content = self._sent
        self._sent = (max(sent_reasoning, len(reasoning)), max(sent_content, len(content)))
        return reasoning[sent_reasoning:], content[sent_content:]
