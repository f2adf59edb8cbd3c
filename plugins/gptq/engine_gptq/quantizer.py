"""GPTQ quantization: linear layers computed from their packed integer weights.

Prequantized checkpoints (AutoGPTQ, GPTQModel, optimum: ``quant_method: gptq``) load
``qweight`` / ``qzeros`` / ``scales`` / ``g_idx`` per linear module (the layout is written
out in :mod:`engine_gptq.packing`); unquantized checkpoints are quantized while loading by
round-to-nearest into the same tensors. Once loaded, each layer holds its weight in the
engine's group-quantized layout (:mod:`engine_gptq.convert`) and computes it with the
platform's kernel (``layer.ops.group_quant_linear``), so it never holds a dense copy.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from engine.interfaces.group_quant import GroupQuantWeight
from engine.interfaces.quantizer import ExpertsMethod, LinearMethod, Quantizer
from engine.layers.group_quant_method import GroupQuantLinearMethod
from engine.layers.quantized_checkpoint import check_tensor_shapes
from engine_gptq.convert import to_group_quant
from engine_gptq.packing import quantize_rtn, values_per_word

logger = logging.getLogger("engine.gptq")

SUPPORTED_BITS = (4, 8)
CHECKPOINT_FORMATS = ("gptq", "gptq_v2")  # v1 stores zero - 1, v2 the zero itself
# what --quantization-config takes (quantizing while loading)
ON_THE_FLY_KEYS = frozenset({"bits", "group_size", "sym", "desc_act", "checkpoint_format", "lm_head"})
TENSORS = ("qweight", "qzeros", "scales")
# the GroupQuantWeight fields a layer holds as parameters (input_order only with act-order)


@dataclass(frozen=True)
class Settings:
    """A validated ``quantization_config``."""

    bits: int = 4
    group_size: int = 128  # -1: one group over all the inputs
    sym: bool = True
    desc_act: bool = False  # act-order: g_idx permutes the input rows' groups
    checkpoint_format: str = "gptq"
    lm_head: bool = False  # the output head quantized too (GPTQModel's lm_head=True; vLLM reads it)

    @property
    def zeros_minus_one(self) -> bool:
        return self.checkpoint_format == "gptq"

    @classmethod
    def parse(cls, config: dict[str, Any], *, prequantized: bool) -> Settings:
        if not prequantized:
            unknown = sorted(set(config) - ON_THE_FLY_KEYS - {"quant_method"})
            if unknown:
                raise ValueError(
                    f"Unknown GPTQ --quantization-config key(s): {', '.join(unknown)}. "
                    f"Known: {', '.join(sorted(ON_THE_FLY_KEYS))}."
                )
        where = "the checkpoint's quantization_config" if prequantized else "--quantization-config"
        bits = config.get("bits", 4)
        if bits not in SUPPORTED_BITS:
            raise ValueError(
                f"GPTQ with bits={bits!r} ({where}) is not supported: engine-gptq computes "
                f"{' and '.join(f'{b}-bit' for b in SUPPORTED_BITS)} GPTQ weights. Use a checkpoint "
                f"quantized to {' or '.join(map(str, SUPPORTED_BITS))} bits."
            )
        group_size = config.get("group_size", 128)
        if not isinstance(group_size, int) or isinstance(group_size, bool) or (group_size < 1 and group_size != -1):
            raise ValueError(f"GPTQ group_size must be -1 or a positive integer, got {group_size!r} ({where}).")
        checkpoint_format = config.get("checkpoint_format", config.get("format", "gptq"))
        if checkpoint_format not in CHECKPOINT_FORMATS or config.get("is_marlin_format"):
            raise ValueError(
                f"GPTQ checkpoint_format {checkpoint_format!r} ({where}) is not supported; engine-gptq reads "
                f"{' and '.join(CHECKPOINT_FORMATS)}. Convert the checkpoint back to the gptq format."
            )
        if config.get("pack_dtype", "int32") not in ("int32", "torch.int32"):
            raise ValueError(f"GPTQ pack_dtype {config['pack_dtype']!r} is not supported; only int32 words.")
        if config.get("dynamic"):
            raise ValueError(
                "The checkpoint's GPTQ quantization_config has per-module overrides (dynamic); engine-gptq "
                "takes one bits / group_size for every layer."
            )
        for key in ("sym", "desc_act", "lm_head"):
            if not isinstance(config.get(key, False), bool):
                raise ValueError(f"GPTQ {key} must be true or false, got {config[key]!r} ({where}).")
        return cls(
            bits=bits,
            group_size=group_size,
            sym=config.get("sym", True),
            desc_act=config.get("desc_act", False),
            checkpoint_format=checkpoint_format,
            lm_head=config.get("lm_head", False),
        )

    def describe(self) -> str:
        group = "one group per row" if self.group_size == -1 else f"groups of {self.group_size}"
        order = ", act-order" if self.desc_act else ""
        head = ", lm_head too" if self.lm_head else ""
        return (
            f"{self.bits}-bit {'symmetric' if self.sym else 'asymmetric'}, {group}{order}{head} "
            f"({self.checkpoint_format})"
        )


def checked_tensors(
    settings: Settings, tensors: dict[str, torch.Tensor], rows: int, inputs: int, what: str
) -> dict[str, torch.Tensor]:
    """One module's GPTQ tensors (``qweight``, ``qzeros``, ``scales``, optional ``g_idx``)
    checked against its shape ([rows, inputs]) and the settings; ``g_idx`` filled in order
    when absent. ``what`` names the module in errors."""
    bits, pack = settings.bits, values_per_word(settings.bits)
    absent = [name for name in TENSORS if name not in tensors]
    if absent:
        raise ValueError(f"{what} has no GPTQ {', '.join(absent)}; a GPTQ module holds {', '.join(TENSORS)}.")
    unknown = sorted(set(tensors) - {*TENSORS, "g_idx"})
    if unknown:
        raise ValueError(f"{what} has tensors a GPTQ module does not hold: {', '.join(unknown)}.")
    tensors = dict(tensors)
    groups = tensors["scales"].shape[0]
    expected = {
        "qweight": ((inputs // pack, rows), (torch.int32,)),
        "qzeros": ((groups, rows // pack), (torch.int32,)),
        "scales": ((groups, rows), (torch.float16, torch.bfloat16, torch.float32)),
    }
    layer = f"a {bits}-bit layer of {inputs} inputs and {rows} outputs"
    check_tensor_shapes(what, "GPTQ", tensors, expected, layer, "is bits in config.json right?")
    size = inputs if settings.group_size == -1 else settings.group_size
    if "g_idx" not in tensors:
        if settings.desc_act:
            raise ValueError(f"{what} has no g_idx, which an act-order (desc_act) GPTQ checkpoint needs.")
        tensors["g_idx"] = torch.arange(inputs, dtype=torch.int32) // size
    g_idx = tensors["g_idx"].to(torch.int32)
    if tuple(g_idx.shape) != (inputs,) or (g_idx.numel() and not 0 <= int(g_idx.min()) <= int(g_idx.max()) < groups):
        raise ValueError(
            f"{what}'s GPTQ g_idx must give each of the {inputs} input rows a group in [0, {groups}); "
            f"got shape {tuple(g_idx.shape)}, values {int(g_idx.min())}..{int(g_idx.max())}."
        )
    tensors["g_idx"] = g_idx
    return tensors


class GptqLinearMethod(GroupQuantLinearMethod):
    """Loads ``qweight`` [K / pack, N], ``qzeros`` [G, N / pack], ``scales`` [G, N] and ``g_idx``
    [K] per output shard (``engine.layers.group_quant_method``): shards that share a ``g_idx`` are
    held as one GroupQuantWeight (parameters ``qweight``, ``scales``, ``offsets`` and, with
    act-order, ``input_order``); shards whose ``g_idx`` differ (act-order, each quantized apart)
    need different input orders, so each run keeps its own (``qweight_<i>``, ...) and the layer
    computes them side by side."""

    format_name = "GPTQ"
    optional_names = ("g_idx",)

    def __init__(self, settings: Settings, prequantized: bool) -> None:
        super().__init__(prequantized)
        self.settings = settings

    def check_layer(self, input_size, output_sizes) -> None:
        pack = values_per_word(self.settings.bits)
        odd = [size for size in [input_size, *output_sizes] if size % pack]
        if odd:
            raise ValueError(
                f"A {self.settings.bits}-bit GPTQ layer packs {pack} values a word; this layer's inputs "
                f"({input_size}) and output shards ({output_sizes}) must be multiples of {pack}."
            )

    def tensor_names(self) -> tuple[str, ...]:
        return TENSORS

    def check(self, tensors, rows, inputs, what) -> dict[str, torch.Tensor]:
        return checked_tensors(self.settings, tensors, rows, inputs, what)

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        s = self.settings
        return quantize_rtn(weight, s.bits, s.group_size, s.sym, s.desc_act, s.zeros_minus_one)

    def convert(self, tensors, rows, inputs, what) -> GroupQuantWeight:
        s = self.settings
        return to_group_quant(**tensors, bits=s.bits, zeros_minus_one=s.zeros_minus_one, what=what)

    def describe(self) -> str:
        return f"GPTQ {self.settings.describe()}, {self.describe_layout()}"


class GptqQuantizer(Quantizer):
    """``quant_method: gptq``: 4-bit or 8-bit integer weights with a scale and zero per group of inputs."""

    name: ClassVar[str] = "gptq"
    # float16 too: GPTQ checkpoints are mostly float16, which the engine then computes in on a GPU
    activation_dtypes: ClassVar[frozenset[str]] = frozenset({"bfloat16", "float16", "float32"})
    # largest relative output error against the unquantized layer, for Gaussian weights and
    # inputs (the kit's layers, round-to-nearest): measured, then given about 25% headroom
    ERROR_BOUNDS: ClassVar[dict[tuple[int, bool], float]] = {
        (4, True): 0.14,  # groups of 128 or fewer
        (4, False): 0.16,  # one group over the inputs
        (8, True): 0.01,
        (8, False): 0.01,
    }

    def __init__(self, settings: Settings, prequantized: bool) -> None:
        self.settings = settings
        self.prequantized = prequantized
        grouped = settings.group_size != -1 and settings.group_size <= 128
        self.error_bound = self.ERROR_BOUNDS[(settings.bits, grouped)]
        logger.info(
            "GPTQ %s, %s",
            settings.describe(),
            "prequantized checkpoint" if prequantized else "quantized while loading (round-to-nearest)",
        )

    @classmethod
    def from_config(cls, quantization_config: dict[str, Any], *, prequantized: bool) -> GptqQuantizer:
        return cls(Settings.parse(quantization_config, prequantized=prequantized), prequantized)

    def get_linear_method(self, layer_name: str) -> LinearMethod | None:
        last = layer_name.split(".")[-1]
        if last == "gate" or (last == "lm_head" and not self.settings.lm_head):  # MoE router; head unless lm_head
            return None
        return GptqLinearMethod(self.settings, self.prequantized)

    def get_experts_method(self, layer_name: str) -> ExpertsMethod | None:
        method = GptqLinearMethod(self.settings, self.prequantized)
        return method.experts_method(f"GPTQ {self.settings.describe()} experts, group-quantized layout")

    def checkpoint_config(self) -> dict[str, Any]:
        s = self.settings
        return {
            "quant_method": "gptq",
            "bits": s.bits,
            "group_size": s.group_size,
            "sym": s.sym,
            "desc_act": s.desc_act,
            "checkpoint_format": s.checkpoint_format,
            "lm_head": s.lm_head,
        }

    def export_weight(self, weight: torch.Tensor, bias: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """The tensors of one GPTQ linear module, quantized by round-to-nearest."""
        tensors = GptqLinearMethod(self.settings, False).quantize(weight)
        if bias is not None:
            tensors["bias"] = bias
        return tensors
