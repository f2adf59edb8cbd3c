"""AWQ quantization: AutoAWQ GEMM checkpoints computed in the engine's group-quantized layout.

Prequantized checkpoints (AutoAWQ, transformers' ``AwqConfig``: ``quant_method: awq``,
``version: gemm``) load ``qweight`` / ``qzeros`` / ``scales`` per linear module (the layout
is written out in :mod:`engine_awq.packing`); unquantized checkpoints are quantized while
loading by round-to-nearest into the same tensors. Once loaded, each layer holds one
:class:`~engine.interfaces.group_quant.GroupQuantWeight` (``offset = scale * zero``, exact)
and computes it with the platform's kernel (``layer.ops.group_quant_linear``).
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
from engine_awq.packing import BITS, PACK, quantize_rtn, unpack

logger = logging.getLogger("engine.awq")

# versions whose checkpoints hold the GEMM tensors: exllama and ipex are AutoAWQ kernels that
# load GEMM state dicts and repack them in memory
GEMM_VERSIONS = ("gemm", "exllama", "ipex")
OTHER_LAYOUTS = {
    "gemv": "AutoAWQ's GEMV layout packs qweight along the inputs, [N, K / 8]",
    "gemv_fast": "AutoAWQ's GEMV-fast layout interleaves qweight for its own kernel",
    "marlin": "the Marlin layout tiles qweight for its own kernel",
}
# what --quantization-config takes (quantizing while loading)
ON_THE_FLY_KEYS = frozenset({"bits", "group_size", "zero_point", "version"})
TENSORS = ("qweight", "qzeros", "scales")


@dataclass(frozen=True)
class Settings:
    """A validated ``quantization_config``."""

    group_size: int = 128  # -1: one group over all the inputs
    zero_point: bool = True  # round-to-nearest with a zero per group (else zero 8, symmetric)
    modules_to_not_convert: tuple[str, ...] = ()

    @classmethod
    def parse(cls, config: dict[str, Any], *, prequantized: bool) -> Settings:
        if not prequantized:
            unknown = sorted(set(config) - ON_THE_FLY_KEYS - {"quant_method"})
            if unknown:
                raise ValueError(
                    f"Unknown AWQ --quantization-config key(s): {', '.join(unknown)}. "
                    f"Known: {', '.join(sorted(ON_THE_FLY_KEYS))}."
                )
        where = "the checkpoint's quantization_config" if prequantized else "--quantization-config"
        version = str(config.get("version", "gemm")).lower()
        if version not in GEMM_VERSIONS:
            why = OTHER_LAYOUTS.get(version, "it is not a layout engine-awq knows")
            raise ValueError(
                f"AWQ version {config.get('version')!r} ({where}) is not supported: {why}. engine-awq reads the "
                f"GEMM layout (version gemm, which exllama and ipex checkpoints also hold); requantize the model "
                f"with AutoAWQ's version GEMM."
            )
        backend = str(config.get("backend", "autoawq")).lower()
        if backend != "autoawq":
            raise ValueError(
                f"AWQ backend {config.get('backend')!r} ({where}) is not supported: engine-awq reads AutoAWQ's "
                f"packing, and llm-awq packs its tensors otherwise. Requantize the model with AutoAWQ."
            )
        bits = config.get("bits", config.get("w_bit", BITS))
        if bits != BITS:
            raise ValueError(
                f"AWQ with bits={bits!r} ({where}) is not supported: engine-awq computes 4-bit AWQ weights, "
                f"the only width AutoAWQ's GEMM layout packs. Use a 4-bit AWQ checkpoint."
            )
        group_size = config.get("group_size", config.get("q_group_size", 128))
        if not isinstance(group_size, int) or isinstance(group_size, bool) or (group_size < 2 and group_size != -1):
            raise ValueError(f"AWQ group_size must be -1 or an integer of at least 2, got {group_size!r} ({where}).")
        if group_size != -1 and group_size % 2:
            raise ValueError(
                f"AWQ group_size {group_size} ({where}) is odd; engine-awq computes groups of an even number of "
                f"inputs (AutoAWQ writes 32, 64 or 128)."
            )
        zero_point = config.get("zero_point", True)
        if not isinstance(zero_point, bool):
            raise ValueError(f"AWQ zero_point must be true or false, got {zero_point!r} ({where}).")
        skipped = config.get("modules_to_not_convert") or ()
        if isinstance(skipped, str) or not all(isinstance(name, str) for name in skipped):
            raise ValueError(f"AWQ modules_to_not_convert must be a list of module names, got {skipped!r} ({where}).")
        return cls(group_size=group_size, zero_point=zero_point, modules_to_not_convert=tuple(skipped))

    def describe(self) -> str:
        group = "one group per row" if self.group_size == -1 else f"groups of {self.group_size}"
        return f"4-bit, {group}, {'zero points' if self.zero_point else 'symmetric'} (GEMM layout)"


def to_group_quant(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> GroupQuantWeight:
    """The GroupQuantWeight of AWQ tensors (one module's, or several joined along N):
    W[n, k] = scales[k // g, n] * q[k, n] - scales[k // g, n] * z[k // g, n]."""
    q = unpack(qweight)  # [K, N]
    zeros = unpack(qzeros)  # [G, N]
    group_scales = scales.float().t()  # [N, G]
    return GroupQuantWeight.from_values(q.t(), group_scales, group_scales * zeros.t().float(), BITS)


def checked_tensors(
    settings: Settings, tensors: dict[str, torch.Tensor], rows: int, inputs: int, what: str
) -> dict[str, torch.Tensor]:
    """One module's AWQ tensors checked against its shape ([rows, inputs]) and the settings;
    ``what`` names the module in errors."""
    absent = [name for name in TENSORS if name not in tensors]
    unknown = sorted(set(tensors) - set(TENSORS))
    if absent or unknown:
        raise ValueError(
            f"{what} holds {', '.join(sorted(tensors))}; an AWQ module holds exactly {', '.join(TENSORS)}."
        )
    groups = 1 if settings.group_size == -1 else inputs // settings.group_size
    expected = {
        "qweight": ((inputs, rows // PACK), (torch.int32,)),
        "qzeros": ((groups, rows // PACK), (torch.int32,)),
        "scales": ((groups, rows), (torch.float16, torch.bfloat16, torch.float32)),
    }
    layer = f"a GEMM-layout layer of {inputs} inputs, {rows} outputs and groups of {settings.group_size}"
    check_tensor_shapes(what, "AWQ", tensors, expected, layer, "are group_size and version in config.json right?")
    return tensors


class AwqLinearMethod(GroupQuantLinearMethod):
    """Loads ``qweight`` [K, N / 8], ``qzeros`` [G, N / 8] and ``scales`` [G, N] per output shard
    (``engine.layers.group_quant_method``), then holds the layer as one GroupQuantWeight over the
    shards joined along N (parameters ``qweight`` uint8 [N, K / 2], ``scales`` and ``offsets``
    float32 [N, G])."""

    format_name = "AWQ"

    def __init__(self, settings: Settings, prequantized: bool) -> None:
        super().__init__(prequantized)
        self.settings = settings

    def check_layer(self, input_size, output_sizes) -> None:
        size = input_size if self.settings.group_size == -1 else self.settings.group_size
        odd = [rows for rows in output_sizes if rows % PACK]
        if odd or input_size % size:
            raise ValueError(
                f"An AWQ layer packs {PACK} outputs a word in groups of {size} inputs; this layer's output shards "
                f"({output_sizes}) must be multiples of {PACK} and its {input_size} inputs a multiple of {size}."
            )

    def tensor_names(self) -> tuple[str, ...]:
        return TENSORS

    def check(self, tensors, rows, inputs, what) -> dict[str, torch.Tensor]:
        return checked_tensors(self.settings, tensors, rows, inputs, what)

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        return quantize_rtn(weight, self.settings.group_size, self.settings.zero_point)

    def convert(self, tensors, rows, inputs, what) -> GroupQuantWeight:
        return to_group_quant(**tensors)

    def describe(self) -> str:
        return f"AWQ {self.settings.describe()}, {self.describe_layout()}"


class AwqQuantizer(Quantizer):
    """``quant_method: awq``: 4-bit integer weights with a scale and zero per group of inputs."""

    name: ClassVar[str] = "awq"
    # float16 too: AWQ checkpoints are float16, which the engine then computes in on a GPU
    activation_dtypes: ClassVar[frozenset[str]] = frozenset({"bfloat16", "float16", "float32"})
    # largest relative output error against the unquantized layer, for Gaussian weights and
    # inputs (the kit's layers, round-to-nearest), by (groups of 128 or fewer, zero_point):
    # measured (0.102, 0.126, 0.111, 0.127), then given about 25% headroom
    ERROR_BOUNDS: ClassVar[dict[tuple[bool, bool], float]] = {
        (True, True): 0.13,
        (True, False): 0.16,
        (False, True): 0.14,
        (False, False): 0.16,
    }

    def __init__(self, settings: Settings, prequantized: bool) -> None:
        self.settings = settings
        self.prequantized = prequantized
        grouped = settings.group_size != -1 and settings.group_size <= 128
        self.error_bound = self.ERROR_BOUNDS[(grouped, settings.zero_point)]
        logger.info(
            "AWQ %s, %s",
            settings.describe(),
            "prequantized checkpoint" if prequantized else "quantized while loading (round-to-nearest)",
        )

    @classmethod
    def from_config(cls, quantization_config: dict[str, Any], *, prequantized: bool) -> AwqQuantizer:
        return cls(Settings.parse(quantization_config, prequantized=prequantized), prequantized)

    def get_linear_method(self, layer_name: str) -> LinearMethod | None:
        if layer_name.split(".")[-1] in ("lm_head", "gate"):  # output head, MoE router
            return None
        if any(module in layer_name for module in self.settings.modules_to_not_convert):
            return None  # left in full precision by the checkpoint (matched as AutoAWQ and vLLM match them)
        return AwqLinearMethod(self.settings, self.prequantized)

    def get_experts_method(self, layer_name: str) -> ExpertsMethod | None:
        if any(module in layer_name for module in self.settings.modules_to_not_convert):
            return None
        method = AwqLinearMethod(self.settings, self.prequantized)
        return method.experts_method(f"AWQ {self.settings.describe()} experts, group-quantized layout")

    def checkpoint_config(self) -> dict[str, Any]:
        s = self.settings
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": s.group_size,
            "zero_point": s.zero_point,
            "version": "gemm",
            **({"modules_to_not_convert": list(s.modules_to_not_convert)} if s.modules_to_not_convert else {}),
        }

    def export_weight(self, weight: torch.Tensor, bias: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """The tensors of one AWQ GEMM linear module, quantized by round-to-nearest."""
        tensors = AwqLinearMethod(self.settings, False).quantize(weight)
        if bias is not None:
            tensors["bias"] = bias
        return tensors
