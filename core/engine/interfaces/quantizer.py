"""The Quantizer interface: a quantization method as a per-layer linear method."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Callable, ClassVar

if TYPE_CHECKING:
    import torch

    from engine.interfaces.fp8 import Fp8Weight
    from engine.interfaces.group_quant import GroupQuantWeight

    # one expert projection as an ExpertsMethod holds it: each has linear(ops, x), joined(other)
    # (gate and up as one weight, or None) and attach(module, suffix)
    ExpertWeight = GroupQuantWeight | Fp8Weight


class LinearMethod(ABC):
    """How one linear layer stores and applies its weight.

    The layer (:class:`engine.layers.linear.MergedLinear`) computes
    ``y = x Wᵀ + b`` with ``W`` made of output shards stacked on the output dim
    (``layer.output_sizes``: e.g. q, k and v), each shard loaded from its own
    checkpoint tensors. Lifecycle:

    1. :meth:`create_weights` registers what the layer holds before loading.
    2. The model's loader calls :meth:`load_weight` with each checkpoint tensor of
       the layer (this rank's part of it, :meth:`local_part`): every name in
       :meth:`checkpoint_tensors` for every shard (and any optional tensor the method
       accepts).
    3. :meth:`process_weights_after_loading` runs once all of them arrived
       (quantize, repack, fuse shards).
    4. :meth:`process_model_after_loading` runs once with every layer given this method,
       in model order, when the whole model has loaded (choices that need all the layers:
       timing kernels on the model's own shapes, say).
    5. :meth:`apply` runs per forward.
    """

    @abstractmethod
    def create_weights(
        self, layer: torch.nn.Module, input_size: int, output_sizes: list[int], bias: bool, dtype: torch.dtype
    ) -> None:
        """Register parameters on ``layer`` for a [sum(output_sizes), input_size] weight."""

    def checkpoint_tensors(self, layer: torch.nn.Module) -> tuple[str, ...]:
        """Names, relative to the layer's checkpoint module (``...q_proj.<name>``),
        that every output shard's checkpoint provides. Default: ``weight`` and, when
        the layer has one, ``bias``."""
        return ("weight", "bias") if layer.has_bias else ("weight",)

    def load_weight(self, layer: torch.nn.Module, name: str, shard: int, tensor: torch.Tensor) -> None:
        """Take the checkpoint tensor ``name`` of output shard ``shard``; raise ``KeyError``
        for a name the method does not load. A method may accept optional tensors
        beyond :meth:`checkpoint_tensors`. Default: copy it into that shard's rows of
        the parameter ``name``."""
        if name not in self.checkpoint_tensors(layer):
            raise KeyError(
                f"{type(self).__name__} does not load a tensor named {name!r}; it loads "
                f"{', '.join(self.checkpoint_tensors(layer))} for each output shard."
            )
        layer.load_shard(name, shard, tensor)

    def local_part(self, layer: torch.nn.Module, name: str, shard: int, tensor: torch.Tensor) -> torch.Tensor:
        """This tensor-parallel rank's part of the checkpoint tensor ``name`` of ``shard``, which
        :meth:`load_weight` then takes. Default: the layer's cut (its rows of a column-parallel
        layer, its input columns of a row-parallel one; the tensor itself on one rank). A
        method whose tensors are not laid out as the weight is (block scales) cuts them
        itself."""
        return layer.local_part(name, shard, tensor)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Repack loaded weights (a no-op by default)."""

    def process_model_after_loading(self, layers: list[torch.nn.Module]) -> None:
        """All the layers this method was given, in model order, after each one's
        :meth:`process_weights_after_loading` (a no-op by default)."""

    def describe(self) -> str | None:
        """A line for logs and ``engine bench`` on what the method chose (kernels, layouts), or
        None (the default) when there is nothing to say beyond its name."""
        return None

    @abstractmethod
    def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x: [T, input_size] -> [T, sum(output_sizes)] in x's dtype, bias included."""

    def apply_argmax(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """For an LM head: each row's index of its largest output ([T] int64; the first of equal
        ones, as ``argmax(apply(layer, x))`` gives it) without the outputs, or None (the default)."""
        return None

    def apply_silu_and_mul(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """For a gated MLP's gate/up layer (two output shards of one size I): ``silu(gate) * up``
        ([T, I]) computed at once, equal to ``ops.silu_and_mul(apply(layer, x))``, or None (the
        default) for the layer to run those two."""
        return None


class ExpertsMethod(ABC):
    """How a quantizer holds a mixture-of-experts layer's routed experts
    (:class:`engine.layers.moe.Experts`): each expert's ``gate_proj``, ``up_proj`` and
    ``down_proj`` as an :data:`ExpertWeight`: in the group-quantized layout
    (``engine.interfaces.group_quant``), computed with the platform's ``group_quant_linear``,
    or as e4m3 bytes with their factors (``engine.interfaces.fp8``), computed with its
    ``fp8_linear``. The experts stage every checkpoint tensor of an expert projection by its
    suffix (``experts.<e>.<proj>.<suffix>``: ``weight`` in an unquantized checkpoint, the
    format's own names in a prequantized one, or ``weight`` carrying its scale where the
    loader keeps an FP8 weight as it is) and, once all are loaded, ask :meth:`expert_weight`
    for the weight."""

    @abstractmethod
    def expert_weight(
        self, tensors: dict[str, torch.Tensor], out_features: int, in_features: int, what: str
    ) -> ExpertWeight:
        """One expert projection ([out_features, in_features]) from its checkpoint ``tensors``
        by suffix: quantized from ``weight`` while loading, or converted from the format's
        tensors. Raise ``ValueError`` naming ``what`` for tensors that do not fit."""

    def describe(self) -> str | None:
        """One line for the logs and ``engine bench``'s setup, or None."""
        return None


class FormatExpertsMethod(ExpertsMethod):
    """An :class:`ExpertsMethod` for a format whose linear modules convert into the
    group-quantized layout: ``convert(tensors, out_features, in_features, what)`` checks one
    module's checkpoint tensors and converts them, ``quantize(weight)`` rounds a dense weight
    [out, in] into the format's tensors (for ``weight``, an unquantized checkpoint)."""

    def __init__(
        self,
        convert: Callable[[dict[str, torch.Tensor], int, int, str], GroupQuantWeight],
        quantize: Callable[[torch.Tensor], dict[str, torch.Tensor]],
        description: str | None = None,
    ) -> None:
        self.convert, self.quantize, self.description = convert, quantize, description

    def expert_weight(self, tensors, out_features, in_features, what) -> GroupQuantWeight:
        if set(tensors) == {"weight"}:  # unquantized: rounded into the format's tensors first
            weight = tensors["weight"]
            if tuple(weight.shape) != (out_features, in_features):
                raise ValueError(
                    f"{what}: the model expects ({out_features}, {in_features}), the checkpoint has "
                    f"{tuple(weight.shape)}."
                )
            tensors = self.quantize(weight)
        return self.convert(tensors, out_features, in_features, what)

    def describe(self) -> str | None:
        return self.description


class Quantizer(ABC):
    """A quantization method.

    - ``name``: registry key, matched against ``quantization_config.quant_method``, or
      ``"<quant_method>/<format>"`` for a quantizer of one of a method's formats (looked up
      first for a checkpoint whose config names that format).
    - ``supported_platforms``: platform names, or None for any.
    - ``activation_dtypes``: compute dtype names it accepts.
    - ``error_bound``: the largest relative error ``‖y_q − y‖ / ‖y‖`` of a quantized
      linear layer's output against the unquantized layer's, for Gaussian weights
      and inputs, that the method promises. An instance may refine it for its
      configuration (4-bit and 8-bit differ).
    """

    name: ClassVar[str]
    supported_platforms: ClassVar[frozenset[str] | None] = None
    activation_dtypes: ClassVar[frozenset[str]] = frozenset({"bfloat16", "float32"})
    error_bound: float = 0.0

    @classmethod
    @abstractmethod
    def from_config(cls, quantization_config: dict[str, Any], *, prequantized: bool) -> Quantizer:
        """Build from a ``quantization_config``.

        ``prequantized``: True when the checkpoint's ``config.json`` carries the
        config and its tensors are already quantized; False for on-the-fly
        quantization of an unquantized checkpoint (``--quantization``), where the
        config is ``--quantization-config`` (``{}`` when not given).
        """

    @classmethod
    def declines(cls, quantization_config: dict[str, Any]) -> str | None:
        """Why this method does not serve a prequantized checkpoint of this
        ``quantization_config`` (a format of its ``quant_method`` it has no kernels for), or
        None (the default) when it does. A checkpoint it declines in a format the engine can
        dequantize (``engine.model_loader.dequant``) is dequantized at load instead."""
        return None

    @abstractmethod
    def get_linear_method(self, layer_name: str) -> LinearMethod | None:
        """The method for the linear layer ``layer_name`` (the model's module path,
        e.g. ``model.layers.0.self_attn.qkv_proj``), or None to leave it unquantized.
        Decline the output head (``lm_head``) and MoE router gates (``...mlp.gate``)."""

    def get_experts_method(self, layer_name: str) -> ExpertsMethod | None:
        """The method for the routed experts ``layer_name`` (e.g. ``model.layers.0.mlp.experts``),
        or None (the default) to keep them dense: an unquantized checkpoint's experts stay in
        the compute dtype, and a prequantized checkpoint's quantized expert tensors are refused
        at load, by name."""
        return None

    def checkpoint_config(self) -> dict[str, Any]:
        """The ``quantization_config`` a prequantized checkpoint of :meth:`export_weight`'s tensors
        carries (``engine quantize`` writes it, with the ``--quantization-config`` given on top),
        complete enough for other engines to read. Default: ``quant_method`` (and ``format``) from
        :attr:`name`."""
        method, _, fmt = self.name.partition("/")
        return {"quant_method": method, **({"format": fmt} if fmt else {})}

    def export_weight(self, weight: torch.Tensor, bias: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """The checkpoint tensors a prequantized checkpoint of this configuration holds
        for one linear module with ``weight`` [out, in] (and ``bias``), keyed by the
        names :meth:`LinearMethod.checkpoint_tensors` lists. Optional: a method that
        provides it has its checkpoint loading checked by the conformance kit."""
        raise NotImplementedError(f"{type(self).__name__} does not export prequantized checkpoints.")
