"""Linear layers whose weight may be several checkpoint tensors stacked on the
output dim, computed by a swappable :class:`LinearMethod`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.interfaces.quantizer import LinearMethod


class UnquantizedLinearMethod(LinearMethod):
    """A plain ``weight`` [out, in] (and ``bias`` [out]) applied with ``F.linear``."""

    def create_weights(
        self, layer: nn.Module, input_size: int, output_sizes: list[int], bias: bool, dtype: torch.dtype
    ) -> None:
        total = sum(output_sizes)
        layer.weight = nn.Parameter(torch.empty(total, input_size, dtype=dtype), requires_grad=False)
        layer.bias = nn.Parameter(torch.empty(total, dtype=dtype), requires_grad=False) if bias else None

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)


class MergedLinear(nn.Module):
    """y = x Wᵀ + b with W = cat(W_0, W_1, ...) along the output dim.

    ``output_sizes`` lists the row count of each shard (e.g. q, k, v); a shard is
    filled from its own checkpoint tensor with :meth:`load_shard`. A single
    output size is a plain linear layer. After loading, the engine may switch
    ``method`` (see :func:`apply_linear_method`).
    """

    def __init__(
        self, input_size: int, output_sizes: list[int], bias: bool, dtype: torch.dtype,
        method: LinearMethod | None = None,
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        self.method = method or UnquantizedLinearMethod()
        self.method.create_weights(self, input_size, self.output_sizes, bias, dtype)

    def _rows(self, shard: int) -> slice:
        start = sum(self.output_sizes[:shard])
        return slice(start, start + self.output_sizes[shard])

    def load_shard(self, param_name: str, shard: int, tensor: torch.Tensor) -> None:
        """Copy ``tensor`` into shard ``shard`` of the ``weight`` or ``bias`` parameter."""
        param = getattr(self, param_name)
        target = param.data[self._rows(shard)]
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(
                f"Shard {shard} of {param_name} expects shape {tuple(target.shape)}, checkpoint has {tuple(tensor.shape)}."
            )
        target.copy_(tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)


def Linear(input_size: int, output_size: int, bias: bool, dtype: torch.dtype) -> MergedLinear:
    return MergedLinear(input_size, [output_size], bias, dtype)


def apply_linear_method(model: nn.Module, method: LinearMethod) -> int:
    """Switch every unquantized :class:`MergedLinear` of a loaded model to ``method``
    and let it repack the weights. Returns the number of layers switched."""
    count = 0
    for module in model.modules():
        if isinstance(module, MergedLinear) and type(module.method) is UnquantizedLinearMethod:
            module.method = method
            method.process_weights_after_loading(module)
            count += 1
    return count


class VocabEmbedding(nn.Module):
    """Token embedding table: weight [vocab_size, hidden_size]."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)
