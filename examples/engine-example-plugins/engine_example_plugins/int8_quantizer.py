"""``example_int8``: weight-only int8 with one float scale per output row, in plain torch.

Checkpoint layout of a prequantized layer (per linear module): ``weight`` int8
[out, in], ``weight_scale`` float32 [out] (and ``bias``), with
``"quantization_config": {"quant_method": "example_int8"}`` in config.json. Any
unquantized checkpoint can be quantized while loading with
``--quantization example_int8``. The weight is dequantized to the activations' dtype
on every call: it saves memory, not time.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from engine.interfaces.quantizer import LinearMethod, Quantizer


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric round-to-nearest: ``weight ≈ q * scale[:, None]`` with q in [-127, 127]."""
    scale = weight.float().abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(weight.float() / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


class Int8LinearMethod(LinearMethod):
    def __init__(self, prequantized: bool) -> None:
        self.prequantized = prequantized

    def create_weights(self, layer, input_size, output_sizes, bias, dtype) -> None:
        rows = sum(output_sizes)
        frozen = lambda t: nn.Parameter(t, requires_grad=False)  # noqa: E731
        layer.weight = frozen(torch.empty(rows, input_size, dtype=torch.int8 if self.prequantized else dtype))
        layer.weight_scale = frozen(torch.empty(rows, dtype=torch.float32)) if self.prequantized else None
        layer.bias = frozen(torch.empty(rows, dtype=dtype)) if bias else None

    def checkpoint_tensors(self, layer) -> tuple[str, ...]:
        names = ("weight", "weight_scale") if self.prequantized else ("weight",)
        return names + (("bias",) if layer.has_bias else ())

    def process_weights_after_loading(self, layer) -> None:
        if not self.prequantized:  # rows are independent: quantizing the fused weight at once is exact
            q, scale = quantize_rows(layer.weight.data)
            layer.weight = nn.Parameter(q, requires_grad=False)
            layer.weight_scale = nn.Parameter(scale, requires_grad=False)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        weight = (layer.weight.to(torch.float32) * layer.weight_scale[:, None]).to(x.dtype)
        return F.linear(x, weight, layer.bias)


class Int8Quantizer(Quantizer):
    name: ClassVar[str] = "example_int8"
    supported_platforms: ClassVar[frozenset[str] | None] = None  # plain torch: anywhere
    activation_dtypes: ClassVar[frozenset[str]] = frozenset({"bfloat16", "float32"})
    error_bound = 0.02  # measured up to 0.007 on the kit's Gaussian layers

    def __init__(self, prequantized: bool) -> None:
        self.prequantized = prequantized

    @classmethod
    def from_config(cls, quantization_config: dict[str, Any], *, prequantized: bool) -> Int8Quantizer:
        unknown = sorted(set(quantization_config) - {"quant_method"})
        if unknown:
            raise ValueError(f"example_int8 takes no settings; got {', '.join(unknown)}.")
        return cls(prequantized)

    def get_linear_method(self, layer_name: str) -> LinearMethod | None:
        if layer_name.split(".")[-1] in ("lm_head", "gate"):  # output head, MoE router
            return None
        return Int8LinearMethod(self.prequantized)

    def export_weight(self, weight: torch.Tensor, bias: torch.Tensor | None) -> dict[str, torch.Tensor]:
        q, scale = quantize_rows(weight)
        return {"weight": q, "weight_scale": scale, **({"bias": bias} if bias is not None else {})}
