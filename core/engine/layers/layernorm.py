from __future__ import annotations

import torch
from torch import nn

from engine.interfaces.ops import REFERENCE_OPS, LayerOps


class RMSNorm(nn.Module):
    """RMSNorm as HF Llama computes it: normalise in fp32, round to the input dtype,
    then scale by the weight.

    ``forward(x)`` normalises x; ``forward(x, residual)`` first adds x to the
    residual stream and returns ``(normalised, new_residual)``, which a platform's
    ops may fuse.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, ops: LayerOps = REFERENCE_OPS):
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.add_rms_norm(x, residual, self.weight, self.eps)
