"""``ngram``: prompt lookup. The drafts are the tokens that followed the most recent
earlier occurrence of the request's last n tokens (n from ``prompt_lookup_max`` down to
``prompt_lookup_min``), anywhere in its prompt or output."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from engine.interfaces.spec_proposer import DraftRequest, Drafts, ProposerInit, SpecProposer

DEFAULTS = {"prompt_lookup_min": 2, "prompt_lookup_max": 5}


def lookup(tokens: np.ndarray, num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """The continuation of the latest earlier match of the longest suffix that has one."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        windows = sliding_window_view(tokens[: length - 1], n)  # every window ending before the last token
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start : start + num_tokens].tolist()
    return []


class NgramProposer(SpecProposer):
    name = "ngram"

    def __init__(self, init: ProposerInit) -> None:
        super().__init__(init)
        settings: dict[str, Any] = {**DEFAULTS, **init.config}
        unknown = sorted(set(settings) - set(DEFAULTS))
        if unknown:
            raise ValueError(f"ngram takes {', '.join(DEFAULTS)}; unknown: {', '.join(unknown)}.")
        self.min_n, self.max_n = settings["prompt_lookup_min"], settings["prompt_lookup_max"]
        if not (isinstance(self.min_n, int) and isinstance(self.max_n, int) and 1 <= self.min_n <= self.max_n):
            raise ValueError(
                f"ngram needs integers 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.min_n} and {self.max_n}."
            )

    def propose(self, requests: Sequence[DraftRequest], num_tokens: int, hidden_states=None) -> Drafts:
        return Drafts(
            [lookup(np.asarray(r.token_ids, dtype=np.int64), num_tokens, self.min_n, self.max_n) for r in requests]
        )
