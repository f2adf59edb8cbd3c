"""What every DeepSeek-V4 layer of one forward pass shares (``Step``): token ids, rope and
cache positions, each rope's cos/sin, and the window ends each query may see, computed
once per step rather than once per layer."""

from __future__ import annotations

import torch

from engine_deepseek_v4.deepseek_v4.rope import Rope


class Step:
    """What every layer of one forward pass shares: positions, token ids, each rope's cos/sin.

    ``cache_positions`` are where the tokens sit in their sequences' caches, which the sliding
    window counts back from; they are the rope ``positions`` except in the MTP block, whose
    cache holds only the positions it ran (compressed layers, which it has none of, use
    ``positions`` throughout)."""

    def __init__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ropes: dict[str, Rope],
        cache_positions: torch.Tensor | None = None,
    ) -> None:
        self.input_ids, self.positions = input_ids, positions
        self.cache_positions = positions if cache_positions is None else cache_positions
        self.ropes = {name: (rope, rope.cos_sin(positions)) for name, rope in ropes.items()}
        self._finished: dict[int, torch.Tensor] = {}

    def finished(self, ratio: int) -> torch.Tensor:
        """[T, n] the last positions of the windows of ``ratio`` that some query of the step has
        reached, -1 where this query has not (at least one column, all -1 if none)."""
        if ratio not in self._finished:
            max_position = int(self.positions.max()) if self.positions.numel() else 0  # only once a layer asks
            ends = torch.arange(max(1, (max_position + 1) // ratio), device=self.positions.device) * ratio
            ends = ends + ratio - 1
            self._finished[ratio] = (
                ends[None, :]
                .expand(self.positions.shape[0], -1)
                .masked_fill(ends[None, :] > self.positions[:, None], -1)
            )
        return self._finished[ratio]
