"""Incremental detokenization and stop strings.

``IncrementalDetokenizer`` turns one request's output tokens into text as they
arrive, decoding only a short window each step (the TGI / vLLM approach):

    prefix_text = decode(ids[prefix_offset:read_offset])  # emitted last time
    new_text    = decode(ids[prefix_offset:])
    emit new_text[len(prefix_text):]  unless it ends in U+FFFD

The tokens emitted last time stay in the window so the tokenizer sees the
context that decides leading spaces (SentencePiece). Text ending in U+FFFD is
held back: the last token stops inside a multi-byte UTF-8 character and the
next one may complete it. Every emitted boundary therefore falls between whole
characters, so the pieces concatenate to ``decode(ids)``; ``flush()`` emits
what is held back when the request ends (then an incomplete character does
become U+FFFD, as in ``decode``).
"""

from __future__ import annotations

from typing import Any

_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Text of one request's output, grown a token at a time.

    ``output_text`` is everything emitted so far (cut at a stop string by
    ``truncate``); ``take_delta`` hands out the text not yet read, holding back
    ``stop_hold_back`` characters while the request runs so that the start of a
    stop string is never streamed before it is known to be one.
    """

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True, stop_hold_back: int = 0) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop_hold_back = stop_hold_back
        self.token_ids: list[int] = []
        self.output_text = ""
        self.prefix_offset = 0
        self.read_offset = 0
        self._prefix_text = ""  # decode(token_ids[prefix_offset:read_offset])
        self._num_chars_read = 0

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> str:
        """Append one token; return the text it makes stable (often "", while a character is incomplete)."""
        self.token_ids.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        """Emit whatever is held back (the request has ended)."""
        return self._emit(final=True)

    def _emit(self, *, final: bool) -> str:
        if self.read_offset == len(self.token_ids):
            return ""
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(new_text) <= len(self._prefix_text) or (not final and new_text.endswith(_REPLACEMENT_CHAR)):
            return ""
        delta = new_text[len(self._prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self._prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        self.output_text += delta
        return delta

    def truncate(self, num_chars: int) -> None:
        """Cut ``output_text`` to its first ``num_chars`` characters (a stop string was found)."""
        self.output_text = self.output_text[:num_chars]

    def take_delta(self, finished: bool) -> str:
        """The text not read before; while not ``finished``, the last ``stop_hold_back`` characters wait."""
        end = len(self.output_text)
        if not finished:
            end = max(self._num_chars_read, end - self.stop_hold_back)
        delta = self.output_text[self._num_chars_read : end]
        self._num_chars_read = end
        return delta


def find_stop_string(text: str, num_new_chars: int, stop: list[str], include_in_output: bool) -> tuple[str, int] | None:
    """The earliest-starting stop string among those that reach into the last
    ``num_new_chars`` characters of ``text``, and the length to cut the text to (before
    it, or after it with ``include_in_output``); None when there is none.

    Only matches reaching into the new characters are looked for: earlier text was
    checked when it was new (a string spanning tokens is caught by looking back
    ``len(stop) - 1`` characters).
    """
    best: tuple[str, int] | None = None
    for stop_str in stop:
        start = max(0, len(text) - num_new_chars - len(stop_str) + 1)
        index = text.find(stop_str, start)
        if index != -1 and (best is None or index < best[1]):
            best = (stop_str, index)
    if best is None:
        return None
    stop_str, index = best
    return stop_str, index + len(stop_str) if include_in_output else index
