"""Linear layers whose weight may be several checkpoint tensors stacked on the output dim."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MergedLinear(nn.Module):
    """y = x Wᵀ + b with W = cat(W_0, W_1, ...) along the output dim.

    ``output_sizes`` lists the row count of each shard (e.g. q, k, v); a shard is
    filled from its own checkpoint tensor with :meth:`load_shard`. A single
    output size is a plain linear layer.
    """

    def __init__(
        self, input_size: int, output_sizes: list[int], bias: bool, dtype: torch.dtype, device: torch.device | None = None
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        total = sum(output_sizes)
        self.weight = nn.Parameter(torch.empty(total, input_size, dtype=dtype, device=device), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.empty(total, dtype=dtype, device=device), requires_grad=False) if bias else None
        )

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
        return F.linear(x, self.weight, self.bias)


def Linear(input_size: int, output_size: int, bias: bool, dtype: torch.dtype, device: torch.device | None = None) -> MergedLinear:
    return MergedLinear(input_size, [output_size], bias, dtype, device)


class VocabEmbedding(nn.Module):
    """Token embedding table: weight [vocab_size, hidden_size]."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype, device=device), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)
