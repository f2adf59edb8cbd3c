"""compressed-tensors ``mxfp4-pack-quantized`` linear layers and routed experts computed in the
engine's group-quantized layout, without dequantizing them at load.

A checkpoint in this format (``quant_method: compressed-tensors``, format
``mxfp4-pack-quantized``, as Kimi-K3's routed experts ship) holds per quantized module
``weight_packed`` (uint8 [N, K / 2]: two e2m1 codes a byte, the element of even index in the
low nibble) and ``weight_scale`` (uint8 [N, K / 32]: a biased exponent ``s`` per 32 elements of
a row, the factor ``2^(s - 127)``; 255 is NaN in the OCP MX format). An e2m1 code is a sign
(bit 3) and a magnitude from ``0, 0.5, 1, 1.5, 2, 3, 4, 6`` (bits 0-2).

Twice an e2m1 value is an integer in -12 .. 12, so a group's elements are exactly

    2^(s - 127) · v = (2^(s - 127) / 2) · ((2 v + 12) − 12)

integers ``2 v + 12`` in 0 .. 24 with the scale ``2^(s - 127) / 2`` (a power of two, exact in
float32) and the zero 12 (``engine.interfaces.group_quant.from_mxfp4``): the layout's symmetric
weights, values stored in 6 bits (8 where a row's inputs are not a multiple of 128), computed by
the platform's ``group_quant_linear`` as any group-quantized layer, on every platform.

Linear layers and routed experts stay in this layout (the output head and the routers are not
quantized); an unquantized checkpoint is rounded to MXFP4 while loading
(``--quantization compressed-tensors/mxfp4-pack-quantized``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from engine.interfaces.group_quant import MXFP4_GROUP, GroupQuantWeight, from_mxfp4
from engine.interfaces.quantizer import ExpertsMethod, LinearMethod, Quantizer
from engine.layers.group_quant_method import GroupQuantLinearMethod
from engine.layers.quantized_checkpoint import quantized_checkpoint
from engine.model_loader.dequant import declines_other_formats
from engine_compressed_tensors.quantizer import Settings

FORMAT = "mxfp4-pack-quantized"
GROUP = MXFP4_GROUP  # elements per shared exponent
MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def to_group_quant(packed: torch.Tensor, scale: torch.Tensor, rows: int, inputs: int, what: str) -> GroupQuantWeight:
    """One module's ``weight_packed`` [rows, inputs / 2] and ``weight_scale`` [rows, inputs / 32]
    as a GroupQuantWeight (values ``2 v + 12``, scales ``2^(s - 127) / 2``, zero 12), exactly."""
    if inputs % GROUP:
        raise ValueError(f"{what}: MXFP4 groups {GROUP} inputs; the module has {inputs}.")
    expected = {"weight_packed": (rows, inputs // 2), "weight_scale": (rows, inputs // GROUP)}
    for name, tensor in (("weight_packed", packed), ("weight_scale", scale)):
        if tuple(tensor.shape) != expected[name] or tensor.dtype not in (torch.uint8, torch.int8):
            raise ValueError(
                f"{what}'s {FORMAT} {name} is {tuple(tensor.shape)} {tensor.dtype}; a module of {inputs} inputs "
                f"and {rows} outputs holds uint8 {expected[name]}."
            )
    try:
        return from_mxfp4(packed, scale)
    except ValueError as error:
        raise ValueError(f"{what}'s weight_scale: {error}.") from None


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense weight [N, K] rounded to MXFP4 (``weight_packed``, ``weight_scale``): per group of
    32, the smallest power of two that brings its largest magnitude to 6 or below, then each
    element to the nearest e2m1 value (ties to the smaller magnitude)."""
    rows, cols = weight.shape
    if cols % GROUP:
        raise ValueError(f"MXFP4 groups {GROUP} inputs; this weight has {cols}.")
    groups = weight.float().view(rows, cols // GROUP, GROUP)
    amax = groups.abs().amax(-1).clamp(min=2.0**-126)
    exponents = torch.ceil(torch.log2(amax / 6)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponents)[..., None]
    magnitude = (scaled.abs()[..., None] - torch.tensor(MAGNITUDES)).abs().argmin(-1)
    codes = (magnitude + 8 * (scaled < 0)).view(rows, cols).to(torch.uint8)
    return codes[:, 0::2] | (codes[:, 1::2] << 4), (exponents + 127).to(torch.uint8)


class Mxfp4LinearMethod(GroupQuantLinearMethod):
    """Loads ``weight_packed`` [N, K / 2] and ``weight_scale`` [N, K / 32] per output shard
    (``engine.layers.group_quant_method``), or rounds a dense weight to MXFP4 once loaded, and
    holds the layer in the group-quantized layout."""

    format_name = FORMAT

    def check_layer(self, input_size, output_sizes) -> None:
        if input_size % GROUP:
            raise ValueError(f"An {FORMAT} layer groups {GROUP} inputs; this one has {input_size}.")

    def tensor_names(self) -> tuple[str, ...]:
        return ("weight_packed", "weight_scale")

    def check(self, tensors, rows, inputs, what) -> dict[str, torch.Tensor]:
        if set(tensors) != set(self.tensor_names()):
            raise ValueError(
                f"{what} holds {', '.join(sorted(tensors))}; an {FORMAT} module holds weight_packed and weight_scale."
            )
        return tensors  # their shapes and dtypes: checked by convert

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        packed, scale = quantize(weight)
        return {"weight_packed": packed, "weight_scale": scale}

    def convert(self, tensors, rows, inputs, what) -> GroupQuantWeight:
        return to_group_quant(tensors["weight_packed"], tensors["weight_scale"], rows, inputs, what)

    def describe(self) -> str:
        return f"compressed-tensors {FORMAT} (e2m1 values doubled, power-of-two scales), {self.describe_layout()}"


class Mxfp4ExpertsMethod(ExpertsMethod):
    """Each expert projection from its ``weight_packed`` and ``weight_scale``: as the checkpoint
    stream passes them (the packed bytes under ``weight``, carrying their scale) or by their own
    names (the linear method's checks and conversion); a dense ``weight`` of an unquantized
    checkpoint is rounded to MXFP4 first (in a prequantized one it is an error: the
    quantization_config did not say so)."""

    def __init__(self, prequantized: bool) -> None:
        self.prequantized = prequantized
        self.format = Mxfp4LinearMethod(prequantized).experts_method(
            f"compressed-tensors {FORMAT} experts (e2m1 values doubled, power-of-two scales), group-quantized layout"
        )

    def expert_weight(self, tensors, out_features, in_features, what) -> GroupQuantWeight:
        weight = tensors.get("weight")
        kept = None if weight is None else quantized_checkpoint(weight)
        if kept is not None and len(tensors) == 1:
            return to_group_quant(weight, kept.scale, out_features, in_features, what)
        if self.prequantized and set(tensors) == {"weight"}:
            raise ValueError(
                f"{what} is a plain {weight.dtype} weight in an {FORMAT} checkpoint whose quantization_config "
                "does not leave the experts out (ignore); expected weight_packed and weight_scale."
            )
        return self.format.expert_weight(tensors, out_features, in_features, what)

    def describe(self) -> str | None:
        return self.format.describe()


class Mxfp4Quantizer(Quantizer):
    """``quant_method: compressed-tensors`` in format ``mxfp4-pack-quantized``: linear layers and
    routed experts computed in MXFP4's own values (the output head and router gates stay in the
    compute dtype)."""

    name: ClassVar[str] = f"compressed-tensors/{FORMAT}"
    activation_dtypes: ClassVar[frozenset[str]] = frozenset({"bfloat16", "float16", "float32"})
    # the relative output error of Gaussian layers rounded to MXFP4 here: measured 0.113, given
    # about 25% headroom
    error_bound: float = 0.14

    def __init__(self, prequantized: bool, quantization_config: dict[str, Any] | None = None) -> None:
        config = quantization_config or {}
        self.prequantized = prequantized
        groups = [g for g in (config.get("config_groups") or {}).values() if isinstance(g, dict)]
        # a prequantized checkpoint's linear layers are MXFP4 where a config group targets
        # "Linear" (less its ignore list); the rest hold plain weights (and any MXFP4 tensor
        # such a layer meets is dequantized at load). Quantizing while loading takes them all.
        self.linear_targeted = not prequantized or any("Linear" in (g.get("targets") or ()) for g in groups)
        self.settings = Settings(ignore=tuple(config.get("ignore") or ()))

    @classmethod
    def declines(cls, quantization_config: dict[str, Any]) -> str | None:
        return declines_other_formats(quantization_config, FORMAT)

    @classmethod
    def from_config(cls, quantization_config: dict[str, Any], *, prequantized: bool) -> Mxfp4Quantizer:
        # on the fly, a config is optional (there is nothing to choose: groups of 32, e2m1, e8m0)
        if prequantized or quantization_config:
            declined = cls.declines(quantization_config)
            if declined is not None:
                raise ValueError(f"compressed-tensors config not served as {FORMAT}: {declined}.")
        return cls(prequantized, quantization_config)

    def get_linear_method(self, layer_name: str) -> LinearMethod | None:
        if layer_name.split(".")[-1] in ("lm_head", "gate"):  # output head, MoE router
            return None
        if not self.linear_targeted or self.settings.ignores(layer_name):
            return None
        return Mxfp4LinearMethod(self.prequantized)

    def get_experts_method(self, layer_name: str) -> ExpertsMethod | None:
        if self.settings.ignores(f"{layer_name}.0.gate_proj"):
            return None
        return Mxfp4ExpertsMethod(self.prequantized)

    def checkpoint_config(self) -> dict[str, Any]:
        return {"quant_method": "compressed-tensors", "format": FORMAT, "ignore": ["lm_head"]}

    def export_weight(self, weight: torch.Tensor, bias: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """One linear module's tensors, rounded to MXFP4."""
        tensors = Mxfp4LinearMethod(False).quantize(weight)
        if bias is not None:
            tensors["bias"] = bias
        return tensors
