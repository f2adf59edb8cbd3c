from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.interfaces.attention import AttentionSpec

if TYPE_CHECKING:
    from engine.interfaces.forward_context import ForwardContext


class Attention(nn.Module):
    """The attention layer of a model: hands q/k/v to the backend selected for
    its KV-cache group, through the step's :class:`ForwardContext`.

    ``layer_index`` is this layer's position in the model's ``kv_cache_specs()``.
    """

    def __init__(self, layer_index: int, spec: AttentionSpec) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.spec = spec

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        # q: [T, H, D]; k, v: [T, Hkv, D] -> [T, H, D]
        return ctx.attention(self.layer_index, q, k, v)
