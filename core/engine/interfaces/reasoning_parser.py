"""The reasoning parser interface: a thinking model's reasoning, split from its answer.

A reasoning model writes its thinking between two markers (``<think>`` … ``</think>`` for
Qwen3, DeepSeek and Kimi) and then its answer. Its chat template often writes the opening
marker into the prompt itself, so the output begins inside the reasoning. A
:class:`ReasoningParser` says where the reasoning is, for a whole text
(:meth:`ReasoningParser.split`) and incrementally (:meth:`ReasoningParser.streamer`); the
two agree whatever the chunks.

The engine also works with the markers as tokens: it counts the reasoning tokens of every
output (usage's ``reasoning_tokens``) and, under a ``thinking_token_budget``, writes the
closing marker's tokens itself once the budget is spent, so that the answer follows.

The default methods implement the common case, which most parsers only configure: the
reasoning is what comes after ``start`` (when the output opens with it, or the prompt left
it open) up to the first ``end``; an output whose reasoning never ends is all reasoning.

Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class ReasoningSplit:
    reasoning: str | None  # None: the output has no reasoning part
    content: str


class ReasoningParser:
    """A model family's reasoning markers. Built once per request as
    ``cls(tokenizer, prompt)`` (``prompt``: the prompt's text, None for token prompts).

    ``start`` / ``end``: the markers; ``forced_end``: the text the engine writes when a
    thinking budget runs out (``end`` unless a family's template follows it with more);
    ``special_tokens``: the markers are special tokens, so the output must be decoded with
    them (``skip_special_tokens=False``).
    """

    name: ClassVar[str]
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"
    forced_end: ClassVar[str | None] = None
    special_tokens: ClassVar[bool] = False

    def __init__(self, tokenizer: Any = None, prompt: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.prompt = prompt

    def starts_in_reasoning(self) -> bool:
        """The prompt leaves a reasoning block open (its last ``start`` comes after its
        last ``end``): the output begins with reasoning."""
        prompt = self.prompt or ""
        opened = prompt.rfind(self.start)
        return opened >= 0 and opened > prompt.rfind(self.end)

    def split(self, text: str) -> ReasoningSplit:
        """The reasoning and the content of a whole output."""
        body = text
        if not self.starts_in_reasoning():
            stripped = text.lstrip()
            if not stripped.startswith(self.start):
                return ReasoningSplit(None, text)
            body = stripped[len(self.start) :]
        reasoning, found, content = body.partition(self.end)
        return ReasoningSplit(reasoning, content if found else "")

    def streamer(self) -> ReasoningStream:
        return ReasoningStream(self)

    # the markers as tokens, for the engine

    def marker_token_ids(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """``(start, end, forced_end)`` as token ids of the tokenizer."""
        encode = self.tokenizer.encode

        def ids(text: str) -> tuple[int, ...]:
            return tuple(encode(text, add_special_tokens=False))

        return ids(self.start), ids(self.end), ids(self.forced_end or self.end)


class ReasoningStream:
    """Incremental :meth:`ReasoningParser.split`: :meth:`feed` each new piece of text, then
    :meth:`finish`; each returns ``(reasoning, content)``, the text that became certain."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.text = ""
        self._sent = (0, 0)  # characters of reasoning and of content sent

    def feed(self, delta: str) -> tuple[str, str]:
        self.text += delta
        return self._diff(self._certain())

    def finish(self) -> tuple[str, str]:
        return self._diff(self.parser.split(self.text))

    def _certain(self) -> ReasoningSplit:
        """The split of the text so far, less any tail that could still be part of a marker."""
        parser, text = self.parser, self.text
        if not parser.starts_in_reasoning():
            stripped = text.lstrip()
            if parser.start.startswith(stripped):
                return ReasoningSplit(None, "")  # the output may yet open with the marker
            if not stripped.startswith(parser.start):
                return ReasoningSplit(None, text)
        split = parser.split(text)
        if split.reasoning is not None and parser.end not in text:
            hold = _held_back(split.reasoning, parser.end)
            return ReasoningSplit(split.reasoning[: len(split.reasoning) - hold], "")
        return split

    def _diff(self, split: ReasoningSplit) -> tuple[str, str]:
        reasoning, content = split.reasoning or "", split.content
        sent_reasoning, sent_content = self._sent
        self._sent = (max(sent_reasoning, len(reasoning)), max(sent_content, len(content)))
        return reasoning[sent_reasoning:], content[sent_content:]


def _held_back(text: str, marker: str) -> int:
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0
