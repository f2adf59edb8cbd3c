"""Per-request sampling parameters (the vLLM-shaped ``SamplingParams``)."""

from __future__ import annotations

from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    - ``temperature``: 0 means greedy; otherwise logits are divided by it.
    - ``top_k``: keep the k most likely tokens (0 or -1: all).
    - ``top_p``: keep the smallest set of tokens whose probability reaches p.
    - ``seed``: a per-request generator, so results do not depend on what else
      is in the batch.
    - ``max_tokens``: output tokens at most; ``stop_token_ids`` end the request
      (the stop token is included in the output, as EOS is) and so does the
      model's EOS unless ``ignore_eos``.
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if self.n != 1:
            raise ValueError(f"n={self.n} is not supported yet; use n=1.")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}.")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if any((not isinstance(t, int)) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids}.")
        self.stop_token_ids = list(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS
