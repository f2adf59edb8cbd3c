"""DeepSeek-V4's rotary embedding: interleaved pairs on the trailing ``qk_rope_head_dim``
dims of a head, cos/sin unscaled, and its inverse (which V4 applies to the attention
output)."""

from __future__ import annotations

from typing import Any

import torch

from engine.layers.rotary import inverse_frequencies


class Rope:
    """Interleaved-pair rope on the trailing ``dim`` dims of a head; cos/sin unscaled."""

    def __init__(self, dim: int, params: dict[str, Any], max_positions: int) -> None:
        self.inv_freq, _ = inverse_frequencies(dim, params, max_positions)  # V4 leaves cos/sin unscaled

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[n] -> cos, sin [n, dim / 2] float32, one angle per pair."""
        if self.inv_freq.device != positions.device:  # moved once, to where the model runs
            self.inv_freq = self.inv_freq.to(positions.device)
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rope on the trailing ``2 · cos.shape[-1]`` dims of x [n, D] or [n, H, D], pairs (x0, x1),
    (x2, x3), ... kept interleaved, in float32; ``inverse`` rotates by the negative angle."""
    dim = 2 * cos.shape[-1]
    if x.dim() == 3:
        cos, sin = cos[:, None, :], sin[:, None, :]
    if inverse:
        sin = -sin
    pairs = x[..., -dim:].float()
    a, b = pairs[..., 0::2], pairs[..., 1::2]
    rotated = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
    return torch.cat([x[..., :-dim], rotated.to(x.dtype)], dim=-1)
