"""FP8 weights kept as e4m3 bytes: a float32 factor per output row and ``block_k`` input
columns (``LayerOps.fp8_linear``'s layout). The routed experts of FP8 checkpoints are held so
(``ExpertsMethod.expert_weight``), as FP8 linear layers are."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.interfaces.ops import LayerOps

# what attach() registers
FP8_HELD_TENSORS = ("fp8_weight", "fp8_scales")


@dataclass(frozen=True)
class Fp8Weight:
    """``weight`` float8_e4m3fn [out, in]; ``scales`` float32 [out, ceil(in / block_k)]: element
    (n, k) stands for ``weight[n, k] * scales[n, k // block_k]``."""

    weight: torch.Tensor
    scales: torch.Tensor
    block_k: int

    def __post_init__(self) -> None:
        if self.weight.dim() != 2 or self.weight.dtype != torch.float8_e4m3fn:
            raise ValueError(
                f"weight is {tuple(self.weight.shape)} {self.weight.dtype}; expected [out, in] float8_e4m3fn"
            )
        n, k = self.weight.shape
        if self.block_k < 1:
            raise ValueError(f"block_k must be at least 1, got {self.block_k}")
        groups = -(-k // self.block_k)
        if tuple(self.scales.shape) != (n, groups) or self.scales.dtype != torch.float32:
            raise ValueError(
                f"scales are {tuple(self.scales.shape)} {self.scales.dtype}; a [{n}, {k}] weight in blocks of "
                f"{self.block_k} inputs has ({n}, {groups}) torch.float32"
            )

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def nbytes(self) -> int:
        return self.weight.numel() + self.scales.numel() * 4

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        factors = self.scales.repeat_interleave(self.block_k, dim=1)[:, : self.in_features]
        return (self.weight.float() * factors).to(dtype)

    def linear(self, ops: LayerOps, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] @ the weight transposed, by the platform's ``fp8_linear``."""
        return ops.fp8_linear(x, self.weight, self.scales, self.block_k)

    def joined(self, other: object) -> Fp8Weight | None:
        """This weight's rows then ``other``'s as one weight, when both take the same inputs in
        the same blocks; else None."""
        if not isinstance(other, Fp8Weight) or (other.in_features, other.block_k) != (self.in_features, self.block_k):
            return None
        return Fp8Weight(torch.cat([self.weight, other.weight]), torch.cat([self.scales, other.scales]), self.block_k)

    def attach(self, layer: torch.nn.Module, suffix: str = "") -> Fp8Weight:
        """Register the tensors as frozen parameters of ``layer`` (``fp8_weight<suffix>``,
        ``fp8_scales<suffix>``) and return the weight made of them."""
        held = {}
        for field, name in zip(("weight", "scales"), FP8_HELD_TENSORS):
            layer.register_parameter(f"{name}{suffix}", torch.nn.Parameter(getattr(self, field), requires_grad=False))
            held[field] = getattr(layer, f"{name}{suffix}")
        return dataclasses.replace(self, **held)
