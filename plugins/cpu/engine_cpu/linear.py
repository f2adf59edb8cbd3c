"""Unquantized linear layers through oneDNN with prepacked weights.

For batch-1 decode, ``F.linear`` on bf16 reaches about a third of the memory
bandwidth that oneDNN's matmul on a weight reordered once into its blocked
layout does; larger batches gain less but never lose.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.linear import UnquantizedLinearMethod


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class OneDNNLinearMethod(UnquantizedLinearMethod):
    """Reorders ``weight`` into oneDNN's layout once, after loading.

    The packed tensor replaces the layer's ``weight`` attribute (a tied
    embedding keeps the original tensor); the result equals ``F.linear``.
    """

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.data, 1)
        layer.weight = nn.Parameter(packed, requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, layer.weight, layer.bias, "none", [], "")
