"""DeepSeek-V4's RMS norms: ``Fp32RMSNorm`` for every norm with a weight (kept and applied
in float32), and the unweighted one of the per-head queries and the hyper-connections."""

from __future__ import annotations

import torch
from torch import nn


class Fp32RMSNorm(nn.Module):
    """RMSNorm with a float32 weight, multiplied in float32 and cast once (as V4 keeps its norms)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=torch.float32), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (self.weight * (x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps))).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
