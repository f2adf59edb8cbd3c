"""``mxfp8``: linear layers holding MXFP8 weights (engine_xpu.mxfp8), multiplied by the
blockwise Triton GEMM on xpu / cuda devices and by dequantize-then-``F.linear`` on the CPU.

A prequantized checkpoint (``quantization_config.quant_method: "mxfp8"``) holds, per
linear module, ``weight`` (float8_e4m3fn [out, in]) and ``weight_scale`` (uint8 or
float8_e8m0fnu [out, in / 32]); an unquantized bf16 / fp32 checkpoint is quantized as
it loads. Scales run along a row's input dim, so the shards of a fused layer (q/k/v,
gate/up) stack on the output dim as they are: quantizing the fused weight and
quantizing each shard give the same bytes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from engine.interfaces.quantizer import LinearMethod, Quantizer
from engine_xpu.mxfp8 import e8m0_bytes, mxfp8_linear_reference, mxfp8_quantize, num_blocks

logger = logging.getLogger("engine.xpu")

CONFIG_KEYS = frozenset({"quant_method", "modules_to_not_convert"})
TRITON_DEVICE_TYPES = ("xpu", "cuda")


@dataclass(frozen=True)
class Settings:
    """A validated ``quantization_config``."""

    skip_modules: tuple[str, ...] = ()

    @classmethod
    def parse(cls, config: dict[str, Any], *, prequantized: bool) -> Settings:
        unknown = sorted(set(config) - CONFIG_KEYS)
        if unknown:
            message = f"Unknown mxfp8 quantization_config key(s): {', '.join(unknown)}."
            if not prequantized:
                raise ValueError(f"{message} Known: {', '.join(sorted(CONFIG_KEYS - {'quant_method'}))}.")
            logger.warning("%s Ignored.", message)
        method = config.get("quant_method", "mxfp8")
        if method != "mxfp8":
            raise ValueError(f"The mxfp8 quantizer was given a quantization_config for {method!r}.")
        skip = config.get("modules_to_not_convert") or ()
        if not isinstance(skip, (list, tuple)) or not all(isinstance(m, str) for m in skip):
            raise ValueError(f"modules_to_not_convert must be a list of module names, got {skip!r}.")
        return cls(skip_modules=tuple(skip))


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


class Mxfp8LinearMethod(LinearMethod):
    """The layer holds ``weight`` (float8_e4m3fn [out, in]), ``weight_scale`` (uint8
    [out, ceil(in / 32)]) and ``bias`` in the model's dtype. Quantizing while loading,
    it holds the plain weight until :meth:`process_weights_after_loading` replaces it."""

    def __init__(self, prequantized: bool) -> None:
        self.prequantized = prequantized

    def create_weights(self, layer, input_size, output_sizes, bias, dtype) -> None:
        rows = sum(output_sizes)
        if self.prequantized:
            layer.weight = _frozen(torch.empty(rows, input_size, dtype=torch.float8_e4m3fn))
            layer.weight_scale = _frozen(torch.empty(rows, num_blocks(input_size), dtype=torch.uint8))
        else:
            layer.weight = _frozen(torch.empty(rows, input_size, dtype=dtype))
        layer.bias = _frozen(torch.empty(rows, dtype=dtype)) if bias else None

    def checkpoint_tensors(self, layer) -> tuple[str, ...]:
        if not self.prequantized:
            return super().checkpoint_tensors(layer)
        return ("weight", "weight_scale", "bias") if layer.has_bias else ("weight", "weight_scale")

    def load_weight(self, layer, name, shard, tensor) -> None:
        if self.prequantized and name == "weight" and tensor.dtype != torch.float8_e4m3fn:
            raise ValueError(
                f"Shard {shard}'s weight is {tensor.dtype}, not float8_e4m3fn: the checkpoint left it unquantized "
                f"(modules_to_not_convert?), but the layer expects MXFP8 elements."
            )
        if self.prequantized and name == "weight_scale":
            tensor = e8m0_bytes(tensor)
        super().load_weight(layer, name, shard, tensor)

    def process_weights_after_loading(self, layer) -> None:
        if not self.prequantized:  # scales run along rows: the fused weight quantizes as its shards do
            elements, scales = mxfp8_quantize(layer.weight.data)
            layer.weight = _frozen(elements)
            layer.weight_scale = _frozen(scales)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        bias = layer.bias.to(x.dtype) if layer.bias is not None else None
        if layer.weight.device.type in TRITON_DEVICE_TYPES:
            from engine_xpu.mxfp8_gemm import mxfp8_linear

            return mxfp8_linear(x, layer.weight, layer.weight_scale, bias)
        return mxfp8_linear_reference(x, layer.weight, layer.weight_scale, bias)


class Mxfp8Quantizer(Quantizer):
    """``quant_method: mxfp8``: e4m3 weights with one power-of-two scale per 32 elements of a row."""

    name: ClassVar[str] = "mxfp8"
    # the GEMM runs on xpu; the CPU path (dequantize, then F.linear) serves as its reference
    supported_platforms: ClassVar[frozenset[str] | None] = frozenset({"xpu", "cpu"})
    activation_dtypes: ClassVar[frozenset[str]] = frozenset({"bfloat16", "float32"})
    # relative output error for Gaussian weights and inputs: measured 0.027 on average and at
    # most 0.029 over 200 random [192, 256] layers (e4m3 keeps 4 significant bits), bf16 or fp32
    error_bound: float = 0.035

    def __init__(self, settings: Settings, prequantized: bool) -> None:
        self.settings = settings
        self.prequantized = prequantized
        logger.info("MXFP8 weights, %s", "prequantized checkpoint" if prequantized else "quantized while loading")

    @classmethod
    def from_config(cls, quantization_config: dict[str, Any], *, prequantized: bool) -> Mxfp8Quantizer:
        return cls(Settings.parse(quantization_config, prequantized=prequantized), prequantized)

    def get_linear_method(self, layer_name: str) -> LinearMethod | None:
        if layer_name.split(".")[-1] in ("lm_head", "gate"):  # output head, MoE router
            return None
        padded = f".{layer_name}."
        if any(f".{module}." in padded for module in self.settings.skip_modules):
            return None
        return Mxfp8LinearMethod(self.prequantized)

    def export_weight(self, weight: torch.Tensor, bias: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """``weight`` (float8_e4m3fn) and ``weight_scale`` (uint8 biased exponents) of one
        linear module, and its ``bias`` as given."""
        elements, scales = mxfp8_quantize(weight)
        tensors = {"weight": elements, "weight_scale": scales}
        if bias is not None:
            tensors["bias"] = bias
        return tensors
