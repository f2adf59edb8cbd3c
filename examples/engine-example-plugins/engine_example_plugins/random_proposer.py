"""``example_random``: a speculative-decoding proposer that drafts uniformly random
tokens. It is the worst proposer there is: every draft is almost surely rejected.
Useful to check that speculation stays lossless and costs little when it cannot
help, and as the smallest proposer a third party can write.

Settings (``--speculative-config``): ``seed`` (default 0).
"""

from __future__ import annotations

import random
from typing import Sequence

from engine.interfaces.spec_proposer import DraftRequest, Drafts, ProposerInit, SpecProposer


class RandomProposer(SpecProposer):
    name = "example_random"

    def __init__(self, init: ProposerInit) -> None:
        super().__init__(init)
        unknown = sorted(set(init.config) - {"seed"})
        if unknown:
            raise ValueError(f"example_random takes seed; unknown: {', '.join(unknown)}.")
        self.rng = random.Random(init.config.get("seed", 0))

    def propose(self, requests: Sequence[DraftRequest], num_tokens: int, hidden_states=None) -> Drafts:
        vocab = self.init.vocab_size
        return Drafts([[self.rng.randrange(vocab) for _ in range(num_tokens)] for _ in requests])
