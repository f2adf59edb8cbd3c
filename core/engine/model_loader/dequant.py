"""Low-precision checkpoint formats dequantized while they load, for platforms that have no
quantizer (no kernels) for them.

DeepSeek publishes its models in FP8 (``quantization_config.quant_method: "fp8"``):

- a quantized weight ``X.weight`` is ``float8_e4m3fn`` and comes with ``X.weight_scale_inv``
  (transformers' name) or ``X.scale`` (the reference checkpoints'), float32 or
  ``float8_e8m0fnu``, one factor per block of ``weight_block_size`` (default 128 × 128)
  of the weight's last two dims (a scalar: one for the whole tensor); the weight is the
  elements times their block's factor;
- DeepSeek-V4's routed experts may be FP4 (``expert_dtype: "fp4"``): ``X.weight`` is int8
  (or uint8) holding two e2m1 values per byte, the element of even index in the low
  nibble, and ``X.scale`` one power-of-two factor (``float8_e8m0fnu``) per 32 elements of
  a row (MXFP4).

compressed-tensors checkpoints in MXFP4 (``quant_method: "compressed-tensors"``, format
``mxfp4-pack-quantized``, as Kimi-K3's routed experts ship) hold ``X.weight_packed`` (uint8,
the same packing: even element in the low nibble) and ``X.weight_scale`` (uint8 biased
exponents, ``2^(s - 127)``, one per 32 elements of a row); the layers the format leaves
alone keep a plain ``X.weight``.

:func:`dequantize_stream` pairs each quantized weight with its scale, wherever in the
files either comes, and yields the dense weight in the model's dtype under ``X.weight``;
every other tensor passes through. A quantized weight whose scale never comes is an
error; a ``.scale`` tensor with no quantized weight of its prefix is an ordinary
parameter (a hyper-connection's ``scale``) and passes through at the end.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

MXFP4_FORMAT = "mxfp4-pack-quantized"
FP8_TYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
PACKED_FP4_TYPES = (torch.int8, torch.uint8)
SCALE_SUFFIXES = (".weight_scale_inv", ".scale")
# e2m1 code (sign bit 3, exponent bits 2-1, mantissa bit 0) -> value
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_GROUP = 32


def dequantizable(config: dict[str, Any]) -> bool:
    """Whether the engine can dequantize a checkpoint of this ``quantization_config`` at load."""
    method = config.get("quant_method")
    if method == "fp8":
        return True
    return method == "compressed-tensors" and _compressed_tensors_formats(config) == {MXFP4_FORMAT}


def _compressed_tensors_formats(config: dict[str, Any]) -> set[str]:
    groups = (config.get("config_groups") or {}).values()
    formats = {group.get("format") for group in groups if isinstance(group, dict) and group.get("format")}
    return formats or {config.get("format")}


class CheckpointDequantizer:
    """The settings of one checkpoint's ``quantization_config`` (``fp8``, or compressed-tensors
    in MXFP4)."""

    def __init__(self, config: dict[str, Any], dtype: torch.dtype) -> None:
        method = config.get("quant_method")
        if not dequantizable(config):
            raise ValueError(
                f"quant_method {method!r} (format {config.get('format')!r}) cannot be dequantized at "
                f"load (supported: fp8, compressed-tensors in {MXFP4_FORMAT})."
            )
        self.dtype = dtype
        self.dequantized = 0
        self.compressed_tensors = method == "compressed-tensors"
        # (quantized weight's suffix, its scales' suffixes)
        self.weight_suffix, self.scale_suffixes = (
            (".weight_packed", (".weight_scale",)) if self.compressed_tensors else (".weight", SCALE_SUFFIXES)
        )
        if self.compressed_tensors:
            self.block = (1, MXFP4_GROUP)
            return
        fmt = config.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"fp8 checkpoints in fmt {fmt!r} are not supported (supported: e4m3).")
        block = config.get("weight_block_size") or (128, 128)
        if len(block) != 2 or min(block) < 1:
            raise ValueError(f"weight_block_size must be two positive sizes, got {block!r}.")
        self.block = (int(block[0]), int(block[1]))

    def dequantize(self, name: str, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The dense weight of ``name`` in the model's dtype."""
        if weight.dtype in FP8_TYPES:
            values = weight.float()
            if scale.dim() == 0 or tuple(scale.shape) == (1,):  # one factor for the whole tensor
                return (values * scale.float().reshape(())).to(self.dtype)
            return (values * self._expand(name, scale.float(), values.shape)).to(self.dtype)
        return self._dequantize_fp4(name, weight, scale)

    def _expand(self, name: str, scale: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """One factor per block of the last two dims -> one per element."""
        rows, cols = shape[-2], shape[-1]
        block_rows, block_cols = self.block
        expected = (*shape[:-2], -(-rows // block_rows), -(-cols // block_cols))
        if tuple(scale.shape) != expected:
            raise ValueError(
                f"{name}: a weight of shape {tuple(shape)} in blocks of {self.block} needs scales of "
                f"shape {expected}, the checkpoint has {tuple(scale.shape)}."
            )
        expanded = scale.repeat_interleave(block_rows, dim=-2)[..., :rows, :]
        return expanded.repeat_interleave(block_cols, dim=-1)[..., :cols]

    def _dequantize_fp4(self, name: str, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        codes = packed.view(torch.uint8)
        low, high = codes & 0x0F, codes >> 4
        table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
        values = torch.stack([table[low.long()], table[high.long()]], dim=-1).flatten(-2)  # [..., 2 · packed cols]
        groups = values.shape[-1] // MXFP4_GROUP
        if values.shape[-1] % MXFP4_GROUP or tuple(scale.shape) != (*values.shape[:-1], groups):
            raise ValueError(
                f"{name}: FP4 weight of {values.shape[-1]} values a row needs one scale per "
                f"{MXFP4_GROUP} of them, shape {(*values.shape[:-1], groups)}; the checkpoint has "
                f"{tuple(scale.shape)}."
            )
        exponents = scale.to(torch.int32) - 127 if scale.dtype == torch.uint8 else None  # compressed-tensors' e8m0
        factors = torch.exp2(exponents.float()) if exponents is not None else scale.float()
        factors = factors.repeat_interleave(MXFP4_GROUP, dim=-1)
        return (values * factors).to(self.dtype)


def dequantize_stream(
    weights: Iterator[tuple[str, torch.Tensor]], dequantizer: CheckpointDequantizer
) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` with every quantized weight and its scale replaced by the dense weight."""
    waiting_weights: dict[str, tuple[str, torch.Tensor]] = {}  # prefix -> (name, quantized weight)
    waiting_scales: dict[str, tuple[str, torch.Tensor]] = {}  # prefix -> (name, scale)
    weight_suffix = dequantizer.weight_suffix
    for name, tensor in weights:
        scale_suffix = next((s for s in dequantizer.scale_suffixes if name.endswith(s)), None)
        if scale_suffix is not None:
            prefix = name[: -len(scale_suffix)]
            if prefix in waiting_weights:
                weight_name, weight = waiting_weights.pop(prefix)
                dequantizer.dequantized += 1
                yield prefix + ".weight", dequantizer.dequantize(weight_name, weight, tensor)
            else:
                waiting_scales[prefix] = (name, tensor)
            continue
        if name.endswith(weight_suffix) and tensor.dtype in FP8_TYPES + PACKED_FP4_TYPES:
            prefix = name[: -len(weight_suffix)]
            if prefix in waiting_scales:
                _, scale = waiting_scales.pop(prefix)
                dequantizer.dequantized += 1
                yield prefix + ".weight", dequantizer.dequantize(name, tensor, scale)
            else:
                waiting_weights[prefix] = (name, tensor)
            continue
        yield name, tensor
    if waiting_weights:
        names = sorted(name for name, _ in waiting_weights.values())
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise ValueError(
            f"These quantized weights have no scale in the checkpoint "
            f"({' or '.join('X' + s for s in dequantizer.scale_suffixes)}): {shown}."
        )
    for name, tensor in waiting_scales.values():  # not a quantization scale: an ordinary tensor
        if name.endswith(".weight_scale_inv"):
            raise ValueError(f"{name} has no quantized weight {name.removesuffix('_scale_inv')} beside it.")
        yield name, tensor
