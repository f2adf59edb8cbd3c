"""The ``gguf`` quantization method: linear layers of a GGUF checkpoint computed from their
quantized blocks.

The engine reads a ``.gguf`` file itself (:mod:`engine.model_loader.gguf`): config, tokenizer,
tensor names. A file with quantized tensors gets ``quant_method: gguf``, and each linear
layer's checkpoint tensors arrive as they are stored: ``weight`` (raw blocks, uint8 [N, bytes
a row], or a dense F32/F16/BF16 [N, K]) with its ``ggml_type``. After loading, each shard's
blocks become the engine's group-quantized layout (:mod:`engine_gguf.blocks`, exact), and the
platform's ``group_quant_linear`` computes them. Shards of one fused layer (q, k, v; gate, up)
may differ in type (llama.cpp's ``Q4_K_M`` keeps some ``attn_v`` in ``Q6_K``): consecutive
shards of one storage width, group size and super-block are joined, the rest computed side by side.

On-the-fly quantization (``--quantization gguf``) quantizes a dense checkpoint's linear layers
by round-to-nearest into one GGUF type (``{"type": "Q4_K"}``; default ``Q8_0``), through the
same blocks a GGUF file holds.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import gguf
import torch
import torch.nn.functional as F
from torch import nn

from engine.interfaces.group_quant import GroupQuantWeight, join, joinable
from engine.interfaces.quantizer import ExpertsMethod, LinearMethod, Quantizer
from engine.layers.quantized_checkpoint import quantized_checkpoint
from engine.model_loader.gguf_quantize import QUANT_TYPES, quantize_blocks
from engine_gguf.blocks import BLOCKS, to_group_quant

logger = logging.getLogger("engine.gguf")

TYPE_TENSOR = "ggml_type"  # engine.model_loader.gguf.TYPE_TENSOR
DENSE_TYPES = ("F32", "F16", "BF16")
ON_THE_FLY_KEYS = frozenset({"type"})


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


def hold(layer: nn.Module, weight: GroupQuantWeight | torch.Tensor, suffix: str) -> GroupQuantWeight | torch.Tensor:
    """Register ``weight``'s tensors as frozen parameters of ``layer`` (``GroupQuantWeight.attach``,
    or ``weight<suffix>`` for a dense part), so that the engine counts and moves them, and
    return the weight made of them."""
    if isinstance(weight, torch.Tensor):
        layer.register_parameter(f"weight{suffix}", _frozen(weight))
        return getattr(layer, f"weight{suffix}")
    return weight.attach(layer, suffix)


def quantize(weight: torch.Tensor, quant_type: str, what: str) -> torch.Tensor:
    """A dense weight [N, K] as ``quant_type`` blocks, uint8 [N, bytes a row] (round-to-nearest)."""
    try:
        return torch.from_numpy(quantize_blocks(weight.detach().float().cpu().numpy(), quant_type))
    except ValueError as exc:
        raise ValueError(f"{what}: {exc} Choose a type of 32-input blocks (Q8_0, Q4_0).") from None


def _joins(a: GroupQuantWeight | torch.Tensor, b: GroupQuantWeight | torch.Tensor) -> bool:
    """Whether shards ``a`` and ``b`` join into one weight: both group-quantized, of one layout."""
    return isinstance(a, GroupQuantWeight) and isinstance(b, GroupQuantWeight) and joinable(a, b)


class GgufLinearMethod(LinearMethod):
    """Each output shard's GGUF ``weight`` and ``ggml_type``; after loading, ``layer.gguf_parts``
    lists ``(first output, end, weight)``: a GroupQuantWeight (parameters ``qweight_<i>``,
    ``scales_<i>``, ``offsets_<i>``) or a dense tensor (``weight_<i>``) in the layer's dtype."""

    def __init__(self, quant_type: str | None = None) -> None:
        self.quant_type = quant_type  # on the fly: the type dense weights are quantized to

    def create_weights(self, layer, input_size, output_sizes, bias, dtype) -> None:
        if self.quant_type is not None:  # a plain weight, quantized after loading
            layer.weight = _frozen(torch.empty(sum(output_sizes), input_size, dtype=dtype))
        layer.bias = _frozen(torch.empty(sum(output_sizes), dtype=dtype)) if bias else None
        layer.gguf_staged = {}  # (name, shard) -> tensor, until loading ends
        layer.gguf_device = torch.empty(0).device

    def checkpoint_tensors(self, layer) -> tuple[str, ...]:
        if self.quant_type is not None:
            return super().checkpoint_tensors(layer)
        return ("weight", TYPE_TENSOR, "bias") if layer.has_bias else ("weight", TYPE_TENSOR)

    def local_part(self, layer, name, shard, tensor) -> torch.Tensor:
        """A tensor-parallel rank's part of the blocks: its rows as they are (a row is one output's
        blocks; rows past the checkpoint's, padding the last rank, are zero blocks, which hold
        zeros), or its inputs' blocks, which must start and end on a block."""
        if self.quant_type is None and name == TYPE_TENSOR:
            return tensor
        kept = quantized_checkpoint(tensor)
        kind = None if kept is None else gguf.GGMLQuantizationType(int(kept.scale)).name
        if self.quant_type is not None or name != "weight" or kind not in BLOCKS or layer.in_slice is None:
            return super().local_part(layer, name, shard, tensor)
        block, nbytes = BLOCKS[kind]
        start, length = layer.in_slice
        if start % block or length % block:
            raise ValueError(
                f"Shard {shard} of a {kind} layer cannot be split across {layer.tp.size} tensor-parallel ranks: "
                f"this rank's inputs {start}..{start + length} do not fall on the type's {block}-input blocks. "
                f"Use another --tensor-parallel-size."
            )
        return tensor.narrow(1, start // block * nbytes, length // block * nbytes)

    def load_weight(self, layer, name, shard, tensor) -> None:
        if self.quant_type is not None or name == "bias":
            super().load_weight(layer, name, shard, tensor)
            return
        if name not in ("weight", TYPE_TENSOR):
            raise KeyError(f"A GGUF linear layer loads weight and {TYPE_TENSOR} for each shard, not {name!r}.")
        layer.gguf_staged[(name, shard)] = tensor

    def _shard(self, layer, shard: int) -> GroupQuantWeight | torch.Tensor:
        rows, inputs = layer.output_sizes[shard], layer.input_size
        what = f"Shard {shard} of a GGUF layer ({rows} outputs, {inputs} inputs)"
        if self.quant_type is not None:
            raw = quantize(layer.weight.data[layer._rows(shard)], self.quant_type, what)
            return to_group_quant(self.quant_type, raw, inputs, what=what)
        kind = gguf.GGMLQuantizationType(int(layer.gguf_staged[(TYPE_TENSOR, shard)])).name
        tensor = layer.gguf_staged[("weight", shard)]
        if kind in DENSE_TYPES:
            if tuple(tensor.shape) != (rows, inputs):
                raise ValueError(f"{what} is {kind} {tuple(tensor.shape)}; expected ({rows}, {inputs}).")
            return tensor.to(layer.dtype, copy=True)
        return to_group_quant(kind, tensor, inputs, what=what)

    def process_weights_after_loading(self, layer) -> None:
        shards = [self._shard(layer, shard) for shard in range(len(layer.output_sizes))]
        del layer.gguf_staged
        if hasattr(layer, "weight"):
            del layer.weight
        device = layer.gguf_device
        layer.gguf_parts = []
        start = 0
        # runs of consecutive shards of one layout, joined along the outputs
        runs: list[list[int]] = []
        for shard, weight in enumerate(shards):
            if runs and _joins(shards[runs[-1][-1]], weight):
                runs[-1].append(shard)
            else:
                runs.append([shard])
        for index, run in enumerate(runs):
            parts = [shards[shard] for shard in run]
            weight = join(parts) if isinstance(parts[0], GroupQuantWeight) else torch.cat(parts)
            end = start + sum(layer.output_sizes[shard] for shard in run)
            suffix = "" if len(runs) == 1 else f"_{index}"
            layer.gguf_parts.append((start, end, hold(layer, weight.to(device), suffix)))
            start = end

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        bias = layer.bias
        if len(layer.gguf_parts) == 1:  # one run (most layers): a decode step calls this for each
            weight = layer.gguf_parts[0][2]
            if isinstance(weight, GroupQuantWeight):
                return layer.ops.group_quant_linear(x, weight, bias)
            return F.linear(x, weight, bias)
        outputs = []
        for first, last, weight in layer.gguf_parts:
            part_bias = None if bias is None else (bias if len(layer.gguf_parts) == 1 else bias[first:last])
            if isinstance(weight, GroupQuantWeight):
                outputs.append(layer.ops.group_quant_linear(x, weight, part_bias))
            else:
                outputs.append(F.linear(x, weight, part_bias))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)

    def describe(self) -> str:
        source = f"{self.quant_type} quantized while loading" if self.quant_type else "GGUF blocks"
        return f"{source}, group-quantized layout, the platform's group_quant_linear"


class GgufExpertsMethod(ExpertsMethod):
    """Each routed expert's projection from its slice of the file's stacked blocks
    (``blk.N.ffn_gate_exps.weight`` [experts, outputs, bytes a row] arrives per expert, its type
    beside it), kept in its blocks' values; on the fly, a dense expert quantized to the type."""

    def __init__(self, quant_type: str | None) -> None:
        self.quant_type = quant_type

    def expert_weight(self, tensors, out_features, in_features, what) -> GroupQuantWeight:
        if set(tensors) - {TYPE_TENSOR} != {"weight"}:
            raise ValueError(
                f"{what}: a GGUF expert holds its weight (and {TYPE_TENSOR}), not {', '.join(sorted(tensors))}."
            )
        tensor = tensors["weight"]
        if self.quant_type is not None and TYPE_TENSOR not in tensors:
            raw = quantize(tensor, self.quant_type, what)
            return to_group_quant(self.quant_type, raw, in_features, what=what)
        # the type: beside the blocks (a safetensors copy of GGUF modules), or carried by them (a GGUF file)
        kept = quantized_checkpoint(tensor)
        code = tensors.get(TYPE_TENSOR, None if kept is None else kept.scale)
        kind = None if code is None else gguf.GGMLQuantizationType(int(code)).name
        if kind is None or kind in DENSE_TYPES:
            raise ValueError(
                f"{what} is {kind or tensor.dtype} in a quantized GGUF file; engine-gguf computes the experts of "
                "such a file in their blocks' types (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K)."
            )
        if tensor.shape[0] != out_features:
            raise ValueError(f"{what} has {tensor.shape[0]} rows; the model expects {out_features}.")
        return to_group_quant(kind, tensor, in_features, what=what)

    def describe(self) -> str:
        source = f"{self.quant_type} quantized while loading" if self.quant_type else "GGUF blocks"
        return f"{source} experts, group-quantized layout"


class GgufQuantizer(Quantizer):
    """``quant_method: gguf`` (set by the engine for a ``.gguf`` file with quantized tensors)."""

    name: ClassVar[str] = "gguf"
    activation_dtypes: ClassVar[frozenset[str]] = frozenset({"bfloat16", "float16", "float32"})
    # largest relative output error against the unquantized layer, for Gaussian weights and inputs
    # (the kit's layers, this round-to-nearest): measured, then given about 25% headroom
    ERROR_BOUNDS: ClassVar[dict[str, float]] = {
        "Q8_0": 0.008,
        "Q6_K": 0.025,
        "Q5_K": 0.05,
        "Q4_K": 0.11,
        "Q4_0": 0.11,
    }

    def __init__(self, quant_type: str | None, output_quantized: bool) -> None:
        self.quant_type = quant_type
        self.output_quantized = output_quantized
        self.error_bound = self.ERROR_BOUNDS[quant_type or "Q4_0"]

    @classmethod
    def from_config(cls, quantization_config: dict[str, Any], *, prequantized: bool) -> GgufQuantizer:
        if prequantized:
            logger.info("GGUF checkpoint with %s blocks", ", ".join(quantization_config.get("types") or ["no"]))
            return cls(None, bool(quantization_config.get("output_quantized")))
        unknown = sorted(set(quantization_config) - ON_THE_FLY_KEYS - {"quant_method"})
        if unknown:
            raise ValueError(
                f"Unknown GGUF --quantization-config key(s): {', '.join(unknown)}. "
                f"Known: {', '.join(sorted(ON_THE_FLY_KEYS))}."
            )
        quant_type = quantization_config.get("type", "Q8_0")
        if quant_type not in QUANT_TYPES or quant_type not in BLOCKS:
            raise ValueError(
                f"GGUF quantization type {quant_type!r} (--quantization-config) is not written here; "
                f"choose one of {', '.join(QUANT_TYPES)}."
            )
        logger.info("GGUF %s, quantized while loading (round-to-nearest)", quant_type)
        return cls(quant_type, False)

    def get_linear_method(self, layer_name: str) -> LinearMethod | None:
        last = layer_name.split(".")[-1]
        if last == "gate":  # MoE router
            return None
        if last == "lm_head" and not self.output_quantized:  # tied to the embedding, or dense in the file
            return None
        return GgufLinearMethod(self.quant_type)

    def get_experts_method(self, layer_name: str) -> ExpertsMethod | None:
        return GgufExpertsMethod(self.quant_type)

    def export_weight(self, weight: torch.Tensor, bias: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """One linear module's tensors as a GGUF file holds them: ``weight`` the blocks of the
        on-the-fly type, ``ggml_type`` that type."""
        quant_type = self.quant_type or "Q8_0"
        kind = getattr(gguf.GGMLQuantizationType, quant_type)
        tensors = {"weight": quantize(weight, quant_type, "The exported weight"), TYPE_TENSOR: torch.tensor(int(kind))}
        if bias is not None:
            tensors["bias"] = bias
        return tensors
