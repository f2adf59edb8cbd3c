"""bitsandbytes quantization: 4-bit NF4 / FP4 and 8-bit LLM.int8, computed by the
bitsandbytes library (``matmul_4bit`` and ``matmul`` with a ``MatmulLtState``).

Checkpoints in the layout transformers writes with ``BitsAndBytesConfig`` load as
they are; unquantized bf16 / fp32 checkpoints are quantized at load with the same
library calls transformers uses, so both paths give the same weights.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, ClassVar

import bitsandbytes as bnb
import bitsandbytes.functional as bnbf
import torch
from torch import nn

from engine.interfaces.quantizer import LinearMethod, Quantizer

logger = logging.getLogger("engine.bitsandbytes")

QUANT_TYPES = ("nf4", "fp4")
BLOCKSIZES = (64, 128, 256, 512, 1024, 2048, 4096)
COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# the keys of transformers' BitsAndBytesConfig (what a checkpoint's quantization_config holds),
# and the one this plugin adds for on-the-fly quantization
CONFIG_KEYS = frozenset(
    {
        "quant_method",
        "load_in_4bit",
        "load_in_8bit",
        "_load_in_4bit",
        "_load_in_8bit",
        "bnb_4bit_quant_type",
        "bnb_4bit_use_double_quant",
        "bnb_4bit_compute_dtype",
        "bnb_4bit_quant_storage",
        "llm_int8_threshold",
        "llm_int8_skip_modules",
        "llm_int8_enable_fp32_cpu_offload",
        "llm_int8_has_fp16_weight",
        "bnb_4bit_blocksize",
    }
)


class _DropFloat16CastWarning(logging.Filter):
    """bitsandbytes logs on every LLM.int8 call that activations are quantized through
    float16; the engine says so once, at load."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("MatMul8bitLt: inputs will be cast")


logging.getLogger("bitsandbytes.autograd._functions").addFilter(_DropFloat16CastWarning())


@dataclass(frozen=True)
class Settings:
    """A validated ``quantization_config``."""

    bits: int  # 4 or 8
    quant_type: str = "nf4"  # 4-bit
    double_quant: bool = False  # 4-bit: absmax quantized again (compress_statistics)
    compute_dtype: torch.dtype | None = None  # 4-bit; None: the activations' dtype
    blocksize: int = 64  # 4-bit, on-the-fly
    threshold: float = 6.0  # 8-bit outlier threshold; 0 turns the decomposition off
    skip_modules: tuple[str, ...] = ()

    @classmethod
    def parse(cls, config: dict[str, Any], *, prequantized: bool) -> Settings:
        unknown = sorted(set(config) - CONFIG_KEYS)
        if unknown:
            message = f"Unknown bitsandbytes quantization_config key(s): {', '.join(unknown)}."
            if not prequantized:
                raise ValueError(f"{message} Known: {', '.join(sorted(CONFIG_KEYS - {'quant_method'}))}.")
            logger.warning("%s Ignored.", message)
        four = bool(config.get("load_in_4bit", config.get("_load_in_4bit", False)))
        eight = bool(config.get("load_in_8bit", config.get("_load_in_8bit", False)))
        if four and eight:
            raise ValueError("quantization_config sets both load_in_4bit and load_in_8bit; choose one.")
        if not four and not eight:
            if prequantized:
                raise ValueError(
                    "The checkpoint's bitsandbytes quantization_config sets neither load_in_4bit nor load_in_8bit."
                )
            four = True  # on-the-fly default: 4-bit NF4
        if config.get("llm_int8_has_fp16_weight"):
            raise ValueError(
                "llm_int8_has_fp16_weight (training with fp16 master weights) is not supported for inference."
            )
        storage = config.get("bnb_4bit_quant_storage", "uint8")
        if storage != "uint8":
            raise ValueError(f"bnb_4bit_quant_storage {storage!r} is not supported; only 'uint8'.")
        skip = config.get("llm_int8_skip_modules") or ()
        if not isinstance(skip, (list, tuple)) or not all(isinstance(m, str) for m in skip):
            raise ValueError(f"llm_int8_skip_modules must be a list of module names, got {skip!r}.")
        threshold = float(config.get("llm_int8_threshold", 6.0))
        if threshold < 0:
            raise ValueError(f"llm_int8_threshold must be >= 0, got {threshold}.")
        if eight:
            return cls(bits=8, threshold=threshold, skip_modules=tuple(skip))
        quant_type = config.get("bnb_4bit_quant_type", "fp4" if prequantized else "nf4")
        if quant_type not in QUANT_TYPES:
            raise ValueError(f"bnb_4bit_quant_type must be one of {', '.join(QUANT_TYPES)}, got {quant_type!r}.")
        compute = config.get("bnb_4bit_compute_dtype")
        if compute is None:
            compute_dtype = torch.float32 if prequantized else None  # transformers' default is float32
        elif compute in COMPUTE_DTYPES:
            compute_dtype = COMPUTE_DTYPES[compute]
        else:
            raise ValueError(f"bnb_4bit_compute_dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {compute!r}.")
        blocksize = int(config.get("bnb_4bit_blocksize", 64))
        if blocksize not in BLOCKSIZES:
            raise ValueError(f"bnb_4bit_blocksize must be one of {BLOCKSIZES}, got {blocksize}.")
        return cls(
            bits=4,
            quant_type=quant_type,
            double_quant=bool(config.get("bnb_4bit_use_double_quant", False)),
            compute_dtype=compute_dtype,
            blocksize=blocksize,
            skip_modules=tuple(skip),
        )

    def describe(self) -> str:
        if self.bits == 8:
            return f"LLM.int8 (threshold {self.threshold})"
        compute = str(self.compute_dtype).removeprefix("torch.") if self.compute_dtype else "activation dtype"
        double = ", double quantization" if self.double_quant else ""
        return f"4-bit {self.quant_type.upper()} (compute {compute}{double})"


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


class BnB4bitLinearMethod(LinearMethod):
    """NF4 / FP4: packed 4-bit codes with one absmax per block, through ``matmul_4bit``.

    The layer holds ``weight`` (uint8, two codes a byte) and ``weight_absmax``. The
    shards of a fused layer (q/k/v, gate/up) are quantized, or stored, one by one; after
    loading they are joined into one weight whose absmax is the shards' (dequantized
    from the second level when double quantization is on, so the join is exact), which
    needs every shard's size to be a multiple of the block size. Otherwise the shards
    stay apart and are multiplied one after the other.
    """

    def __init__(self, settings: Settings, prequantized: bool) -> None:
        self.settings = settings
        self.prequantized = prequantized

    def create_weights(self, layer, input_size, output_sizes, bias, dtype) -> None:
        if not self.prequantized:  # a plain weight, quantized after loading
            layer.weight = _frozen(torch.empty(sum(output_sizes), input_size, dtype=dtype))
        layer.bias = _frozen(torch.empty(sum(output_sizes), dtype=dtype)) if bias else None
        layer.bnb_staged = {}  # prequantized: (name, shard) -> tensor, until loading ends

    def checkpoint_tensors(self, layer) -> tuple[str, ...]:
        if not self.prequantized:
            return super().checkpoint_tensors(layer)
        names = ["weight", "weight.absmax", "weight.quant_map"]
        if self.settings.double_quant:
            names += ["weight.nested_absmax", "weight.nested_quant_map"]
        names.append(f"weight.quant_state.bitsandbytes__{self.settings.quant_type}")
        if layer.has_bias:
            names.append("bias")
        return tuple(names)

    def load_weight(self, layer, name, shard, tensor) -> None:
        if not self.prequantized or name == "bias":
            super().load_weight(layer, name, shard, tensor)
            return
        if name not in self.checkpoint_tensors(layer):
            raise KeyError(
                f"A {self.settings.describe()} checkpoint has no tensor {name!r} for a linear layer; expected "
                f"{', '.join(self.checkpoint_tensors(layer))} (is bnb_4bit_use_double_quant / bnb_4bit_quant_type "
                f"in config.json right?)."
            )
        if name == "weight" and tensor.dtype != torch.uint8:
            raise ValueError(
                f"Shard {shard}'s weight is {tensor.dtype}, not packed 4-bit uint8: the checkpoint left it "
                f"unquantized (llm_int8_skip_modules?), but the other shards of its fused layer are quantized."
            )
        layer.bnb_staged[(name, shard)] = tensor

    def _shard_states(self, layer) -> list[tuple[torch.Tensor, bnbf.QuantState]]:
        shapes = [(rows, layer.input_size) for rows in layer.output_sizes]
        states = []
        for shard, shape in enumerate(shapes):
            if self.prequantized:
                staged = {name: t for (name, s), t in layer.bnb_staged.items() if s == shard}
                data = staged.pop("weight")
                state = bnbf.QuantState.from_dict(
                    {k.removeprefix("weight."): v for k, v in staged.items()}, device=torch.device("cpu")
                )
                if tuple(state.shape) != shape:
                    raise ValueError(
                        f"Shard {shard} was quantized from a {tuple(state.shape)} weight; the model expects {shape}."
                    )
            else:
                rows = layer.weight.data[layer._rows(shard)].contiguous()
                data, state = bnbf.quantize_4bit(
                    rows,
                    blocksize=self.settings.blocksize,
                    compress_statistics=self.settings.double_quant,
                    quant_type=self.settings.quant_type,
                    quant_storage=torch.uint8,
                )
            states.append((data, state))
        return states

    def process_weights_after_loading(self, layer) -> None:
        states = self._shard_states(layer)
        del layer.bnb_staged
        if hasattr(layer, "weight"):
            del layer.weight
        first = states[0][1]
        joinable = all(
            s.blocksize == first.blocksize
            and s.quant_type == first.quant_type
            and s.dtype == first.dtype
            and torch.equal(s.code, first.code)
            and torch.Size(s.shape).numel() % s.blocksize == 0
            for _, s in states
        )
        parts = states
        if len(states) > 1 and joinable:
            absmax = torch.cat([_plain_absmax(s) for _, s in states])
            shape = torch.Size([sum(layer.output_sizes), layer.input_size])
            state = bnbf.QuantState(
                absmax=absmax,
                shape=shape,
                code=first.code,
                blocksize=first.blocksize,
                quant_type=first.quant_type,
                dtype=first.dtype,
            )
            parts = [(torch.cat([d.view(-1) for d, _ in states]).view(-1, 1), state)]
        layer.bnb_parts = []
        for index, (data, state) in enumerate(parts):
            suffix = "" if len(parts) == 1 else f"_{index}"
            layer.register_parameter(f"weight{suffix}", _frozen(data))
            layer.register_parameter(f"weight_absmax{suffix}", _frozen(state.absmax))
            if state.nested:
                layer.register_parameter(f"weight_nested_absmax{suffix}", _frozen(state.state2.absmax))
            layer.bnb_parts.append((getattr(layer, f"weight{suffix}"), state))

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        compute = self.settings.compute_dtype or x.dtype
        xc = x.to(compute)
        bias = layer.bias.to(compute) if layer.bias is not None else None
        if len(layer.bnb_parts) == 1:
            data, state = layer.bnb_parts[0]
            return bnb.matmul_4bit(xc, data.t(), state, bias=bias).to(x.dtype)
        outputs = [bnb.matmul_4bit(xc, data.t(), state) for data, state in layer.bnb_parts]
        y = torch.cat(outputs, dim=-1)
        if bias is not None:
            y = y + bias
        return y.to(x.dtype)


def _plain_absmax(state: bnbf.QuantState) -> torch.Tensor:
    """The float32 absmax of every block, undoing the second quantization level."""
    if not state.nested:
        return state.absmax.float()
    return bnbf.dequantize_blockwise(state.absmax, state.state2) + state.offset


class BnB8bitLinearMethod(LinearMethod):
    """LLM.int8: int8 rows with one float scale each (``SCB``), multiplied by
    bitsandbytes with activations quantized per row and outlier columns (above the
    threshold) computed in float16."""

    def __init__(self, settings: Settings, prequantized: bool) -> None:
        self.settings = settings
        self.prequantized = prequantized

    def create_weights(self, layer, input_size, output_sizes, bias, dtype) -> None:
        rows = sum(output_sizes)
        weight_dtype = torch.int8 if self.prequantized else dtype
        layer.weight = _frozen(torch.empty(rows, input_size, dtype=weight_dtype))
        if self.prequantized:
            layer.SCB = _frozen(torch.empty(rows, dtype=torch.float32))
        layer.bias = _frozen(torch.empty(rows, dtype=dtype)) if bias else None

    def checkpoint_tensors(self, layer) -> tuple[str, ...]:
        if not self.prequantized:
            return super().checkpoint_tensors(layer)
        return ("weight", "SCB", "bias") if layer.has_bias else ("weight", "SCB")

    def load_weight(self, layer, name, shard, tensor) -> None:
        if self.prequantized and name == "weight_format":  # optional; transformers writes 0, row-major
            if int(tensor.item()) != 0:
                raise ValueError(f"LLM.int8 weight_format {int(tensor.item())} is not supported; only 0 (row).")
            return
        if self.prequantized and name == "weight" and tensor.dtype != torch.int8:
            raise ValueError(
                f"Shard {shard}'s weight is {tensor.dtype}, not int8: the checkpoint left it unquantized "
                f"(llm_int8_skip_modules?), but the other shards of its fused layer are quantized."
            )
        super().load_weight(layer, name, shard, tensor)

    def process_weights_after_loading(self, layer) -> None:
        if not self.prequantized:  # rows are quantized independently: the fused weight at once is exact
            weight, scale, _ = bnbf.int8_vectorwise_quant(layer.weight.data.contiguous().to(torch.float16))
            layer.weight = _frozen(weight)
            layer.SCB = _frozen(scale)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        state = bnb.MatmulLtState()
        state.CB, state.SCB = layer.weight.data, layer.SCB.data
        state.threshold = self.settings.threshold
        state.has_fp16_weights = False
        state.is_training = False
        bias = layer.bias.to(x.dtype) if layer.bias is not None else None
        return bnb.matmul(x, layer.weight.data, bias=bias, state=state)


class BitsAndBytesQuantizer(Quantizer):
    """``quant_method: bitsandbytes``: NF4 / FP4 (``load_in_4bit``) or LLM.int8 (``load_in_8bit``)."""

    name: ClassVar[str] = "bitsandbytes"
    supported_platforms: ClassVar[frozenset[str] | None] = frozenset({"cpu", "cuda", "rocm", "xpu"})
    activation_dtypes: ClassVar[frozenset[str]] = frozenset({"bfloat16", "float32"})
    # relative output error for Gaussian weights and inputs (the kit's layers): measured at
    # most 0.093 (NF4), 0.127 (FP4, blocksize 128) and 0.010 (LLM.int8), bf16 or fp32
    ERROR_BOUNDS: ClassVar[dict[str, float]] = {"nf4": 0.12, "fp4": 0.16, "int8": 0.02}

    def __init__(self, settings: Settings, prequantized: bool) -> None:
        self.settings = settings
        self.prequantized = prequantized
        self.error_bound = self.ERROR_BOUNDS["int8" if settings.bits == 8 else settings.quant_type]
        self._declined_experts = False
        logger.info(
            "bitsandbytes %s, %s",
            settings.describe(),
            "prequantized checkpoint" if prequantized else "quantized while loading",
        )
        if settings.bits == 8:
            logger.info("LLM.int8 quantizes activations through float16, as bitsandbytes does")

    @classmethod
    def from_config(cls, quantization_config: dict[str, Any], *, prequantized: bool) -> BitsAndBytesQuantizer:
        return cls(Settings.parse(quantization_config, prequantized=prequantized), prequantized)

    def get_linear_method(self, layer_name: str) -> LinearMethod | None:
        parts = layer_name.split(".")
        if parts[-1] in ("lm_head", "gate"):  # output head, MoE router
            return None
        padded = f".{layer_name}."
        if any(f".{module}." in padded for module in self.settings.skip_modules):
            return None
        if "experts" in parts:
            if not self._declined_experts:
                logger.warning(
                    "bitsandbytes: MoE expert layers (%s, ...) stay unquantized; this plugin "
                    "quantizes dense linear layers only",
                    layer_name,
                )
                self._declined_experts = True
            return None
        method = BnB8bitLinearMethod if self.settings.bits == 8 else BnB4bitLinearMethod
        return method(self.settings, self.prequantized)

    def export_weight(self, weight: torch.Tensor, bias: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """The tensors transformers writes for one ``Linear4bit`` / ``Linear8bitLt``."""
        if self.settings.bits == 8:
            data, scale, _ = bnbf.int8_vectorwise_quant(weight.contiguous().to(torch.float16))
            tensors = {"weight": data, "SCB": scale, "weight_format": torch.tensor(0, dtype=torch.uint8)}
        else:
            data, state = bnbf.quantize_4bit(
                weight.contiguous(),
                blocksize=self.settings.blocksize,
                compress_statistics=self.settings.double_quant,
                quant_type=self.settings.quant_type,
                quant_storage=torch.uint8,
            )
            tensors = {"weight": data, **{f"weight.{k}": v for k, v in state.as_dict(packed=True).items()}}
        if bias is not None:
            tensors["bias"] = bias
        return tensors
