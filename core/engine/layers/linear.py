"""Linear layers whose weight may be several checkpoint tensors stacked on the
output dim, computed by a swappable :class:`LinearMethod`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.interfaces.quantizer import LinearMethod, Quantizer


class UnquantizedLinearMethod(LinearMethod):
    """A plain ``weight`` [out, in] (and ``bias`` [out]) applied with ``F.linear``."""

    def create_weights(
        self, layer: nn.Module, input_size: int, output_sizes: list[int], bias: bool, dtype: torch.dtype
    ) -> None:
        total = sum(output_sizes)
        layer.weight = nn.Parameter(torch.empty(total, input_size, dtype=dtype), requires_grad=False)
        layer.bias = nn.Parameter(torch.empty(total, dtype=dtype), requires_grad=False) if bias else None

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)


class MergedLinear(nn.Module):
    """y = x Wᵀ + b with W = cat(W_0, W_1, ...) along the output dim.

    ``output_sizes`` lists the row count of each shard (e.g. q, k, v); a shard is
    filled from its own checkpoint tensors with :meth:`load_checkpoint_tensor`. A
    single output size is a plain linear layer. The engine may give the layer a
    quantized method before loading (:func:`quantize_model`) or a faster
    unquantized one after (:func:`apply_linear_method`).
    """

    def __init__(
        self, input_size: int, output_sizes: list[int], bias: bool, dtype: torch.dtype,
        method: LinearMethod | None = None,
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        self.has_bias = bias
        self.dtype = dtype
        self.set_method(method or UnquantizedLinearMethod())

    def set_method(self, method: LinearMethod) -> None:
        """Replace the layer's parameters by those ``method`` creates (before loading)."""
        for name in list(self._parameters):
            delattr(self, name)
        self._received: set[tuple[str, int]] = set()  # (checkpoint tensor name, shard) loaded so far
        self.method = method
        method.create_weights(self, self.input_size, self.output_sizes, self.has_bias, self.dtype)

    def _rows(self, shard: int) -> slice:
        start = sum(self.output_sizes[:shard])
        return slice(start, start + self.output_sizes[shard])

    def load_shard(self, param_name: str, shard: int, tensor: torch.Tensor) -> None:
        """Copy ``tensor`` into shard ``shard`` of the ``weight`` or ``bias`` parameter."""
        param = getattr(self, param_name)
        target = param.data[self._rows(shard)]
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(
                f"Shard {shard} of {param_name} expects shape {tuple(target.shape)}, checkpoint has {tuple(tensor.shape)}."
            )
        target.copy_(tensor)

    def load_checkpoint_tensor(self, name: str, shard: int, tensor: torch.Tensor) -> bool:
        """Hand the checkpoint tensor ``name`` (``weight``, ``bias``, ``weight.absmax``, ...)
        of output shard ``shard`` to the method; True once every tensor of every shard
        arrived."""
        if not 0 <= shard < len(self.output_sizes):
            raise IndexError(f"Shard {shard} out of range for a layer of {len(self.output_sizes)} shard(s).")
        self.method.load_weight(self, name, shard, tensor)
        self._received.add((name, shard))
        return not self.missing_tensors()

    def missing_tensors(self) -> list[str]:
        """Checkpoint tensors not loaded yet, as ``name[shard]``."""
        return [
            f"{name}[{shard}]"
            for shard in range(len(self.output_sizes))
            for name in self.method.checkpoint_tensors(self)
            if (name, shard) not in self._received
        ]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)


def Linear(input_size: int, output_size: int, bias: bool, dtype: torch.dtype) -> MergedLinear:
    return MergedLinear(input_size, [output_size], bias, dtype)


def linear_layers(model: nn.Module) -> dict[str, MergedLinear]:
    """Every :class:`MergedLinear` of ``model`` by module path."""
    return {name: module for name, module in model.named_modules() if isinstance(module, MergedLinear)}


def tied_linear_layers(model: nn.Module) -> dict[str, str]:
    """Linear layers whose weight is another module's parameter (an LM head tied to the
    embedding): layer path -> the module that owns the weight. They load nothing."""
    owners = {
        id(param): path for path, module in model.named_modules() if not isinstance(module, MergedLinear)
        for param in module.parameters(recurse=False)
    }
    return {
        path: owners[id(param)] for path, layer in linear_layers(model).items()
        for param in layer.parameters() if id(param) in owners
    }


def route_linear_tensor(
    layers: dict[str, MergedLinear], name: str, stacked: dict[str, tuple[str, int]] | None = None
) -> tuple[str, int, str] | None:
    """Where the checkpoint tensor ``name`` goes when it belongs to a linear layer:
    ``(layer path, shard, tensor name within the layer)``, else None.

    ``stacked`` maps a checkpoint module name to the fused module holding it and its
    shard (``{"q_proj": ("qkv_proj", 0), ...}``). The tensor name is whatever follows
    the module (``weight``, ``bias``, ``weight.absmax``, ``SCB``, ...), so a model's
    loader routes quantized checkpoints without knowing their layout.
    """
    parts = name.split(".")
    for end in range(1, len(parts)):
        module = parts[end - 1]
        if stacked and module in stacked:  # fused where the model fuses it (a layer of that name may stand alone)
            fused, shard = stacked[module]
            path = ".".join([*parts[: end - 1], fused])
            if path in layers:
                return path, shard, ".".join(parts[end:])
        path = ".".join(parts[:end])
        if path in layers:
            return path, 0, ".".join(parts[end:])
    return None


def quantize_model(model: nn.Module, quantizer: Quantizer) -> tuple[list[str], list[str]]:
    """Give every linear layer of a model not loaded yet the method ``quantizer``
    chooses for it. Returns the layer paths (quantized, declined)."""
    tied = tied_linear_layers(model)
    quantized, declined = [], []
    for path, layer in linear_layers(model).items():
        method = quantizer.get_linear_method(path)
        if method is None:
            declined.append(path)
            continue
        if path in tied:
            raise ValueError(
                f"Quantizer {quantizer.name!r} chose to quantize {path}, whose weight is tied to {tied[path]}; "
                f"a quantizer must decline tied layers."
            )
        layer.set_method(method)
        quantized.append(path)
    return quantized, declined


def apply_linear_method(model: nn.Module, method: LinearMethod) -> int:
    """Switch every unquantized :class:`MergedLinear` of a loaded model to ``method``
    and let it repack the weights. Returns the number of layers switched."""
    count = 0
    for module in model.modules():
        if isinstance(module, MergedLinear) and type(module.method) is UnquantizedLinearMethod:
            module.method = method
            method.process_weights_after_loading(module)
            count += 1
    return count


class VocabEmbedding(nn.Module):
    """Token embedding table: weight [vocab_size, hidden_size]."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)
