"""A quantized checkpoint weight passed on as it is, carrying its scale, and how a
destination that holds dense values takes it (see :mod:`engine.model_loader.dequant`,
which attaches the scale)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

FP8_TYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
QUANTIZED_ATTR = "quantized_checkpoint"


@dataclass
class QuantizedCheckpoint:
    """What a quantized weight kept as it is carries (:attr:`CheckpointDequantizer.keep_quantized`):
    its checkpoint name, its name and its scale's within the layer (``weight`` or
    ``weight_packed``; ``weight_scale_inv`` for both of DeepSeek's spellings, ``weight_scale``
    for compressed-tensors), the scale, and the dequantizer that makes the pair dense."""

    name: str
    weight_name: str
    scale_name: str
    scale: torch.Tensor
    dequantizer: Any  # engine.model_loader.dequant.CheckpointDequantizer

    def dense(self, weight: torch.Tensor) -> torch.Tensor:
        self.dequantizer.dequantized += 1
        return self.dequantizer.dequantize(self.name, weight, self.scale)


def quantized_checkpoint(tensor: torch.Tensor) -> QuantizedCheckpoint | None:
    """The scale a quantized weight kept as it is carries, or None for any other tensor."""
    return getattr(tensor, QUANTIZED_ATTR, None)


def dense_tensor(name: str, tensor: torch.Tensor, target_dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` as a destination holding ``target_dtype`` values takes it: a quantized weight
    kept as it is becomes dense (unless the destination holds its dtype); an FP8 tensor with no scale beside it is an error rather than
    values silently taken without their scale."""
    kept = quantized_checkpoint(tensor)
    if kept is not None and target_dtype != tensor.dtype:  # a place for the quantized values takes them
        return kept.dense(tensor)
    if tensor.dtype in FP8_TYPES and target_dtype not in FP8_TYPES:
        raise ValueError(
            f"{name} is {tensor.dtype} with no scale beside it, and its place in the model holds "
            f"{target_dtype}: the checkpoint's quantization_config does not describe this tensor."
        )
    return tensor


def check_tensor_shapes(
    what: str,
    fmt: str,
    tensors: dict[str, torch.Tensor],
    expected: dict[str, tuple[tuple[int, ...], tuple[torch.dtype, ...]]],
    layer: str,
    hint: str,
) -> None:
    """Raise ``ValueError`` for the first of a module's checkpoint ``tensors`` whose shape or dtype
    is not the ``expected`` ``(shape, dtypes)`` of its name: "<what>'s <fmt> <name> is <shape>
    <dtype>; <layer> expects <shape> <dtype> (<hint>)."."""
    for name, (shape, dtypes) in expected.items():
        tensor = tensors[name]
        if tuple(tensor.shape) != shape or tensor.dtype not in dtypes:
            raise ValueError(
                f"{what}'s {fmt} {name} is {tuple(tensor.shape)} {tensor.dtype}; {layer} expects {shape} "
                f"{dtypes[0]} ({hint})."
            )
