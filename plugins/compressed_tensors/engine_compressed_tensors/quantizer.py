"""compressed-tensors ``pack-quantized`` checkpoints computed in the engine's group-quantized layout.

Prequantized checkpoints (``quant_method: compressed-tensors``, format ``pack-quantized``, as
llm-compressor writes W4A16 and W8A16 models) load ``weight_packed`` / ``weight_scale`` /
``weight_shape`` (and ``weight_zero_point`` when asymmetric) per linear module (the layout is
written out in :mod:`engine_compressed_tensors.packing`); unquantized checkpoints are quantized
while loading by round-to-nearest into the same tensors (``--quantization
compressed-tensors/pack-quantized``). Once loaded, each layer holds one
:class:`~engine.interfaces.group_quant.GroupQuantWeight` (values offset by ``2**(bits-1)``,
``offset = scale * (zero + 2**(bits-1))``, exact) and computes it with the platform's kernel
(``layer.ops.group_quant_linear``).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from engine.interfaces.group_quant import GroupQuantWeight
from engine.interfaces.quantizer import ExpertsMethod, LinearMethod, Quantizer
from engine.layers.group_quant_method import GroupQuantLinearMethod
from engine.layers.quantized_checkpoint import check_tensor_shapes
from engine.model_loader.dequant import declines_other_formats
from engine_compressed_tensors.packing import PACKED_BITS, pack_factor, quantize_rtn, unpack

logger = logging.getLogger("engine.compressed_tensors")

FORMAT = "pack-quantized"
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INTEGER_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
# the checkpoint modules a merged layer of the engine is made of
MERGED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# on-the-fly quantization without --quantization-config: W4A16 in groups of 128, symmetric
DEFAULT_WEIGHTS = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True}


@dataclass(frozen=True)
class Settings:
    """A validated ``quantization_config`` (its one weight scheme and its ignore list)."""

    bits: int = 4
    group_size: int | None = 128  # None: strategy channel, one group a row
    symmetric: bool = True
    ignore: tuple[str, ...] = ()

    @classmethod
    def parse(cls, config: dict[str, Any], *, prequantized: bool) -> Settings:
        where = "the checkpoint's quantization_config" if prequantized else "--quantization-config"
        groups = config.get("config_groups")
        if not groups and not prequantized:
            groups = {"group_0": {"targets": ["Linear"], "weights": DEFAULT_WEIGHTS}}
        if not isinstance(groups, dict) or not groups:
            raise ValueError(
                f"A compressed-tensors quantization_config ({where}) needs config_groups, each with its weights' "
                f"scheme; got {groups!r}."
            )
        schemes = {name: cls._parse_group(name, group, where) for name, group in groups.items()}
        if len(set(schemes.values())) > 1:
            raise ValueError(
                f"The config_groups of {where} quantize weights differently ({schemes}); engine-compressed-tensors "
                f"computes one weight scheme a model. Requantize the model with a single scheme."
            )
        bits, group_size, symmetric = next(iter(schemes.values()))
        ignore = config.get("ignore") or ()
        if isinstance(ignore, str) or not all(isinstance(entry, str) for entry in ignore):
            raise ValueError(f"compressed-tensors ignore must be a list of module names, got {ignore!r} ({where}).")
        return cls(bits=bits, group_size=group_size, symmetric=symmetric, ignore=tuple(ignore))

    @staticmethod
    def _parse_group(name: str, group: Any, where: str) -> tuple[int, int | None, bool]:
        """(bits, group_size or None per channel, symmetric) of one config group."""
        if not isinstance(group, dict):
            raise ValueError(f"config_groups.{name} ({where}) must be a mapping, got {group!r}.")
        fmt = group.get("format")
        if fmt not in (None, FORMAT):
            raise ValueError(
                f"config_groups.{name} ({where}) is in format {fmt!r}; engine-compressed-tensors reads {FORMAT}."
            )
        if group.get("input_activations") is not None:
            raise ValueError(
                f"config_groups.{name} ({where}) quantizes the input activations too "
                f"({group['input_activations']!r}, a W8A8-style scheme); engine-compressed-tensors runs "
                f"weight-only schemes (W4A16, W8A16). Use a weight-only checkpoint."
            )
        if group.get("output_activations") is not None:
            raise ValueError(f"config_groups.{name} ({where}) quantizes output activations, which is not supported.")
        targets = group.get("targets", ["Linear"])
        if list(targets) != ["Linear"]:
            raise ValueError(
                f"config_groups.{name} ({where}) targets {targets!r}; engine-compressed-tensors takes groups that "
                f'target every linear layer (["Linear"]), with the layers left alone listed in ignore.'
            )
        weights = group.get("weights")
        if not isinstance(weights, dict):
            raise ValueError(
                f"config_groups.{name}.weights ({where}) must describe the weights' scheme, got {weights!r}."
            )
        bits = weights.get("num_bits")
        if weights.get("type", "int") != "int" or bits not in PACKED_BITS:
            raise ValueError(
                f"config_groups.{name}.weights ({where}) are {bits!r}-bit {weights.get('type', 'int')!r}; "
                f"engine-compressed-tensors computes 4- or 8-bit int weights."
            )
        if weights.get("dynamic", False):
            raise ValueError(f"config_groups.{name}.weights ({where}) are dynamic; packed weights need static scales.")
        if weights.get("actorder") == "group":
            raise ValueError(
                f"config_groups.{name}.weights ({where}) use actorder 'group' (a weight_g_idx per module), which "
                f"engine-compressed-tensors does not read; requantize with actorder 'weight' or none."
            )
        symmetric = weights.get("symmetric", True)
        if not isinstance(symmetric, bool):
            raise ValueError(
                f"config_groups.{name}.weights.symmetric ({where}) must be true or false, got {symmetric!r}."
            )
        strategy = weights.get("strategy")
        if strategy == "channel":
            return bits, None, symmetric
        if strategy != "group":
            raise ValueError(
                f"config_groups.{name}.weights ({where}) use strategy {strategy!r}; engine-compressed-tensors "
                f"computes 'group' (with group_size) and 'channel'."
            )
        group_size = weights.get("group_size")
        if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 2 or group_size % 2:
            raise ValueError(
                f"config_groups.{name}.weights.group_size ({where}) must be an even integer of at least 2, "
                f"got {group_size!r}."
            )
        return bits, group_size, symmetric

    def describe(self) -> str:
        group = "one group per row" if self.group_size is None else f"groups of {self.group_size}"
        return f"{self.bits}-bit, {group}, {'symmetric' if self.symmetric else 'zero points'} ({FORMAT})"

    def groups(self, input_size: int) -> int:
        return 1 if self.group_size is None else input_size // self.group_size

    def ignores(self, layer_name: str) -> bool:
        """Whether ``ignore`` names the layer (exact names or dotted suffixes, ``re:`` regexes),
        directly or through the checkpoint modules a merged layer is made of (all of them, or
        none: a merged layer is quantized whole)."""
        prefix, _, last = layer_name.rpartition(".")
        parts = [f"{prefix}.{part}" if prefix else part for part in MERGED_PARTS.get(last, ())]
        if self._matches(layer_name):
            return True
        matched = [part for part in parts if self._matches(part)]
        if matched and len(matched) != len(parts):
            raise ValueError(
                f"compressed-tensors ignore leaves {', '.join(matched)} unquantized but not the rest of "
                f"{', '.join(parts)}, which the engine computes as one layer ({layer_name}); ignore all of them or none."
            )
        return bool(matched)

    def _matches(self, name: str) -> bool:
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.match(entry[3:], name):
                    return True
            elif f".{entry}." in f".{name}.":
                return True
        return False


def to_group_quant(tensors: dict[str, torch.Tensor], settings: Settings, rows: int, inputs: int) -> GroupQuantWeight:
    """The GroupQuantWeight of one module's (or one output shard's) ``pack-quantized`` tensors:
    W[n, k] = scale[n, k // g] * u[n, k] - scale[n, k // g] * (z[n, k // g] + 2**(bits-1))."""
    bits, offset = settings.bits, 1 << (settings.bits - 1)
    values = unpack(tensors["weight_packed"], bits, inputs)  # [N, K], q + offset
    scales = tensors["weight_scale"].float()  # [N, G]
    zeros = tensors.get("weight_zero_point")
    if zeros is None:
        stored_zeros = torch.full_like(scales, offset)
    elif zeros.dtype == torch.int32 and zeros.shape[0] != rows:  # packed along the outputs
        stored_zeros = unpack(zeros, bits, rows, dim=0).float()
    else:  # unpacked, signed (earlier versions of the library)
        stored_zeros = zeros.float() + offset
    return GroupQuantWeight.from_values(values, scales, scales * stored_zeros, bits)


def checked_tensors(
    settings: Settings, tensors: dict[str, torch.Tensor], rows: int, inputs: int, what: str
) -> dict[str, torch.Tensor]:
    """One module's pack-quantized tensors checked against its shape ([rows, inputs]) and the
    settings; ``what`` names the module in errors."""
    names = ("weight_packed", "weight_scale", "weight_shape")
    absent = [name for name in names if name not in tensors]
    unknown = sorted(set(tensors) - {*names, "weight_zero_point"})
    if absent or unknown:
        raise ValueError(
            f"{what} holds {', '.join(sorted(tensors))}; a pack-quantized module holds {', '.join(names)} "
            "and, when asymmetric, weight_zero_point."
        )
    per_word, groups = pack_factor(settings.bits), settings.groups(inputs)
    expected = {
        "weight_packed": ((rows, -(-inputs // per_word)), (torch.int32,)),
        "weight_scale": ((rows, groups), SCALE_DTYPES),
    }
    zeros = tensors.get("weight_zero_point")
    if zeros is not None:
        packed = zeros.dtype == torch.int32 and zeros.shape[0] != rows
        expected["weight_zero_point"] = ((-(-rows // per_word) if packed else rows, groups), INTEGER_DTYPES)
    layer = f"a layer of {inputs} inputs and {rows} outputs, {settings.describe()},"
    hint = "do config_groups' num_bits, strategy and group_size in config.json match the tensors?"
    check_tensor_shapes(what, "pack-quantized", tensors, expected, layer, hint)
    shape = tensors["weight_shape"]
    if shape.dtype not in INTEGER_DTYPES or shape.tolist() != [rows, inputs]:
        raise ValueError(f"{what}'s weight_shape is {shape.tolist()}; this module is [{rows}, {inputs}].")
    return tensors


class PackQuantizedLinearMethod(GroupQuantLinearMethod):
    """Loads ``weight_packed`` [N, K / p], ``weight_scale`` [N, G], ``weight_shape`` [2] (and
    ``weight_zero_point``) per output shard (``engine.layers.group_quant_method``), then holds the
    layer as one GroupQuantWeight over the shards joined along N (parameters ``qweight`` uint8,
    ``scales`` and ``offsets`` float32 [N, G])."""

    format_name = "pack-quantized"
    # a symmetric checkpoint may still carry zero points (all zero), as earlier versions wrote
    optional_names = ("weight_zero_point",)

    def __init__(self, settings: Settings, prequantized: bool) -> None:
        super().__init__(prequantized)
        self.settings = settings

    def check_layer(self, input_size, output_sizes) -> None:
        if self.settings.group_size is not None and input_size % self.settings.group_size:
            raise ValueError(
                f"A pack-quantized layer in groups of {self.settings.group_size} inputs needs its {input_size} "
                f"inputs to be a multiple of {self.settings.group_size}."
            )
        if input_size % 2:
            raise ValueError(f"A pack-quantized layer needs an even number of inputs, not {input_size}.")

    def tensor_names(self) -> tuple[str, ...]:
        names = ("weight_packed", "weight_scale", "weight_shape")
        return names if self.settings.symmetric else (*names, "weight_zero_point")

    def refuse(self, name: str) -> None:
        if name == "weight_g_idx":
            raise ValueError(
                "This pack-quantized checkpoint holds weight_g_idx (activation order by group), which "
                "engine-compressed-tensors does not read; requantize with actorder 'weight' or none."
            )

    def check(self, tensors, rows, inputs, what) -> dict[str, torch.Tensor]:
        return checked_tensors(self.settings, tensors, rows, inputs, what)

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        size = self.settings.group_size or weight.shape[1]
        return quantize_rtn(weight, self.settings.bits, size, self.settings.symmetric, weight.dtype)

    def convert(self, tensors, rows, inputs, what) -> GroupQuantWeight:
        return to_group_quant(tensors, self.settings, rows, inputs)

    def describe(self) -> str:
        return f"compressed-tensors {self.settings.describe()}, {self.describe_layout()}"


class PackQuantizedQuantizer(Quantizer):
    """``quant_method: compressed-tensors`` in format ``pack-quantized``: 4- or 8-bit integer
    weights with a scale (and a zero point when asymmetric) per group of inputs or per row."""

    name: ClassVar[str] = "compressed-tensors/pack-quantized"
    activation_dtypes: ClassVar[frozenset[str]] = frozenset({"bfloat16", "float16", "float32"})
    # largest relative output error against the unquantized layer, for Gaussian weights and
    # inputs (the kit's layers, round-to-nearest), by (bits, groups of 128 or fewer, symmetric):
    # measured (4-bit: 0.112, 0.101, 0.120, 0.110; 8-bit: 0.0067, 0.0062, 0.0071, 0.0067), then
    # given about 25% headroom
    ERROR_BOUNDS: ClassVar[dict[tuple[int, bool, bool], float]] = {
        (4, True, True): 0.14,
        (4, True, False): 0.13,
        (4, False, True): 0.15,
        (4, False, False): 0.14,
        (8, True, True): 0.009,
        (8, True, False): 0.009,
        (8, False, True): 0.009,
        (8, False, False): 0.009,
    }

    def __init__(self, settings: Settings, prequantized: bool) -> None:
        self.settings = settings
        self.prequantized = prequantized
        grouped = settings.group_size is not None and settings.group_size <= 128
        self.error_bound = self.ERROR_BOUNDS[(settings.bits, grouped, settings.symmetric)]
        logger.info(
            "compressed-tensors %s, %s",
            settings.describe(),
            "prequantized checkpoint" if prequantized else "quantized while loading (round-to-nearest)",
        )

    @classmethod
    def declines(cls, quantization_config: dict[str, Any]) -> str | None:
        return declines_other_formats(quantization_config, FORMAT)

    @classmethod
    def from_config(cls, quantization_config: dict[str, Any], *, prequantized: bool) -> PackQuantizedQuantizer:
        if prequantized:
            declined = cls.declines(quantization_config)
            if declined is not None:
                raise ValueError(f"compressed-tensors checkpoint not served by engine-compressed-tensors: {declined}.")
        return cls(Settings.parse(quantization_config, prequantized=prequantized), prequantized)

    def get_linear_method(self, layer_name: str) -> LinearMethod | None:
        if layer_name.split(".")[-1] in ("lm_head", "gate"):  # output head, MoE router
            return None
        if self.settings.ignores(layer_name):
            return None  # left in full precision by the checkpoint
        return PackQuantizedLinearMethod(self.settings, self.prequantized)

    def get_experts_method(self, layer_name: str) -> ExpertsMethod | None:
        if self.settings.ignores(f"{layer_name}.0.gate_proj"):
            return None
        method = PackQuantizedLinearMethod(self.settings, self.prequantized)
        return method.experts_method(f"compressed-tensors {self.settings.describe()} experts, group-quantized layout")

    def checkpoint_config(self) -> dict[str, Any]:
        s = self.settings
        weights = {
            "num_bits": s.bits,
            "type": "int",
            "symmetric": s.symmetric,
            "dynamic": False,
            "strategy": "channel" if s.group_size is None else "group",
            **({} if s.group_size is None else {"group_size": s.group_size}),
        }
        return {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
            "ignore": sorted({"lm_head", *s.ignore}),
        }

    def export_weight(self, weight: torch.Tensor, bias: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """The tensors of one pack-quantized linear module, quantized by round-to-nearest."""
        tensors = PackQuantizedLinearMethod(self.settings, False).quantize(weight)
        if bias is not None:
            tensors["bias"] = bias
        return tensors
