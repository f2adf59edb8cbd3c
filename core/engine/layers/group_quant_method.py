"""A linear method for checkpoint formats whose modules convert into the group-quantized
layout (``engine.interfaces.group_quant``): GPTQ, AWQ, compressed-tensors ``pack-quantized``.

A prequantized checkpoint's tensors are staged per output shard while loading; an unquantized
one loads a plain weight, quantized by the format's round-to-nearest once loading ends. Each
shard then converts into a :class:`GroupQuantWeight`; consecutive shards that share a layout and
an input order are joined along the outputs, and the layer holds ``layer.group_quant``, a list
of ``(first output, end, weight)``: one run holds its tensors as parameters ``qweight``,
``scales``, ``offsets`` (``input_order``), several as ``qweight_<i>`` and so on. ``apply``
computes every run with the platform's ``group_quant_linear``."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from engine.interfaces.group_quant import GroupQuantWeight, join, joinable
from engine.interfaces.quantizer import FormatExpertsMethod, LinearMethod


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


class GroupQuantLinearMethod(LinearMethod):
    """Subclass with ``format_name`` (for errors) and the format's hooks: :meth:`check_layer`,
    :meth:`tensor_names`, :meth:`check`, :meth:`quantize`, :meth:`convert` (and, to refuse a
    tensor with a message of its own, :meth:`refuse`)."""

    format_name: ClassVar[str]
    optional_names: ClassVar[tuple[str, ...]] = ()  # tensors a module may hold besides tensor_names()

    def __init__(self, prequantized: bool) -> None:
        self.prequantized = prequantized

    # the format's hooks

    def check_layer(self, input_size: int, output_sizes: list[int]) -> None:
        """Raise ``ValueError`` for a layer shape the format cannot hold."""

    def tensor_names(self) -> tuple[str, ...]:
        """The tensors every prequantized module holds."""
        raise NotImplementedError

    def check(self, tensors: dict[str, torch.Tensor], rows: int, inputs: int, what: str) -> dict[str, torch.Tensor]:
        """One module's prequantized tensors checked against its shape ([rows, inputs])."""
        raise NotImplementedError

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """A dense weight [rows, inputs] as the format's tensors (round-to-nearest)."""
        raise NotImplementedError

    def convert(self, tensors: dict[str, torch.Tensor], rows: int, inputs: int, what: str) -> GroupQuantWeight:
        """One module's (checked) tensors in the group-quantized layout."""
        raise NotImplementedError

    def refuse(self, name: str) -> None:
        """Raise for a tensor name the format knows and does not read (default: nothing)."""

    # the linear method

    def create_weights(self, layer, input_size, output_sizes, bias, dtype) -> None:
        self.check_layer(input_size, list(output_sizes))
        if not self.prequantized:  # a plain weight, quantized after loading
            layer.weight = _frozen(torch.empty(sum(output_sizes), input_size, dtype=dtype))
        layer.bias = _frozen(torch.empty(sum(output_sizes), dtype=dtype)) if bias else None
        layer.quant_staged = {}  # prequantized: (name, shard) -> tensor, until loading ends
        layer.quant_device = torch.empty(0).device

    def checkpoint_tensors(self, layer) -> tuple[str, ...]:
        if not self.prequantized:
            return super().checkpoint_tensors(layer)
        return (*self.tensor_names(), "bias") if layer.has_bias else self.tensor_names()

    def local_part(self, layer, name, shard, tensor) -> torch.Tensor:
        if self.prequantized and layer.tp.is_parallel and name != "bias":
            raise ValueError(
                f"{self.format_name} tensor {name!r} of shard {shard} cannot be split across {layer.tp.size} "
                f"tensor-parallel ranks yet; load this checkpoint with --tensor-parallel-size 1."
            )
        return super().local_part(layer, name, shard, tensor)

    def load_weight(self, layer, name, shard, tensor) -> None:
        if not self.prequantized or name == "bias":
            super().load_weight(layer, name, shard, tensor)
            return
        self.refuse(name)
        if name not in (*self.tensor_names(), *self.optional_names):
            optional = f" and optionally {', '.join(self.optional_names)}" if self.optional_names else ""
            raise KeyError(
                f"A {self.format_name} checkpoint has no tensor {name!r} for a linear layer; expected "
                f"{', '.join(self.checkpoint_tensors(layer))}{optional}."
            )
        layer.quant_staged[(name, shard)] = tensor

    def _shard(self, layer, shard: int) -> GroupQuantWeight:
        rows, inputs = layer.output_sizes[shard], layer.input_size
        what = f"Shard {shard}"
        if not self.prequantized:
            tensors = self.quantize(layer.weight.data[layer._rows(shard)])
        else:
            staged = {name: t for (name, s), t in layer.quant_staged.items() if s == shard}
            tensors = self.check(staged, rows, inputs, what)
        return self.convert(tensors, rows, inputs, f"{what} of a {self.format_name} layer")

    def process_weights_after_loading(self, layer) -> None:
        shards = [self._shard(layer, shard) for shard in range(len(layer.output_sizes))]
        del layer.quant_staged
        if hasattr(layer, "weight"):
            del layer.weight
        runs: list[list[int]] = []  # consecutive shards that join
        for shard, weight in enumerate(shards):
            if runs and joinable(shards[runs[-1][-1]], weight):
                runs[-1].append(shard)
            else:
                runs.append([shard])
        layer.group_quant = []
        start = 0
        for index, run in enumerate(runs):
            weight = join([shards[shard] for shard in run]).to(layer.quant_device)
            suffix = "" if len(runs) == 1 else f"_{index}"
            layer.group_quant.append((start, start + weight.out_features, weight.attach(layer, suffix)))
            start += weight.out_features

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        runs: list[tuple[int, int, GroupQuantWeight]] = layer.__dict__["group_quant"]
        bias = layer.bias
        if len(runs) == 1:
            return layer.ops.group_quant_linear(x, runs[0][2], bias)
        return torch.cat(
            [
                layer.ops.group_quant_linear(x, weight, None if bias is None else bias[first:last])
                for first, last, weight in runs
            ],
            dim=-1,
        )

    def describe_layout(self) -> str:
        return "group-quantized layout, the platform's group_quant_linear"

    def experts_method(self, description: str | None = None) -> FormatExpertsMethod:
        """The format's routed experts (``Quantizer.get_experts_method``): each expert projection
        checked and converted by this method's hooks, or quantized from a dense weight."""

        def convert(tensors, rows, inputs, what) -> GroupQuantWeight:
            return self.convert(self.check(tensors, rows, inputs, what), rows, inputs, what)

        return FormatExpertsMethod(convert, self.quantize, description)
