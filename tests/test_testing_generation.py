"""engine.testing.generation's near-tie check against hand-built logits."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from engine.testing.generation import diverges_only_at_a_near_tie


class FixedLogits:
    """A stand-in for a transformers model: the same last-position logits after any sequence."""

    def __init__(self, logits: list[float]) -> None:
        self.logits = torch.tensor(logits)
        self.seen: list[list[int]] = []

    def __call__(self, ids: torch.Tensor) -> SimpleNamespace:
        self.seen.append(ids[0].tolist())
        return SimpleNamespace(logits=self.logits.view(1, 1, -1).expand(1, ids.shape[1], -1))


def test_equal_continuations_need_no_logits():
    model = FixedLogits([0.0, 1.0])
    assert diverges_only_at_a_near_tie(model, [5], [1, 1], [1, 1])
    assert model.seen == []
    assert not diverges_only_at_a_near_tie(model, [5], [1], [1, 1])  # one stopped early


def test_a_parting_at_a_tie_passes_and_one_at_a_clear_winner_fails():
    tied = FixedLogits([4.0, 3.99, 4.0, -1.0])  # tokens 0 and 2 tie; 1 is 0.01 / 4 below
    assert diverges_only_at_a_near_tie(tied, [7, 8], [3, 0, 1], [3, 2, 2])
    assert tied.seen == [[7, 8, 3]]  # the logits where they first part
    assert diverges_only_at_a_near_tie(tied, [7], [1], [0])  # 0.0025 relative: within 2^-6
    assert not diverges_only_at_a_near_tie(tied, [7], [1], [0], rtol=2**-9)
    assert not diverges_only_at_a_near_tie(tied, [7], [3], [0])  # -1 against 4
