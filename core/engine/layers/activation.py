from __future__ import annotations

import torch

from engine.layers.ops import REFERENCE_OPS, LayerOps


def silu_and_mul(x: torch.Tensor, ops: LayerOps = REFERENCE_OPS) -> torch.Tensor:
    """x: [T, 2 * d] holding gate then up -> silu(gate) * up: [T, d]."""
    return ops.silu_and_mul(x)
