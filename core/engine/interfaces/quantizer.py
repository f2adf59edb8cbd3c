"""The Quantizer interface: a quantization method as a per-layer linear method."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch


class LinearMethod(ABC):
    """How one linear layer stores and applies its weight.

    Lifecycle: :meth:`create_weights` registers parameters on ``layer``; the loader
    fills them by name; :meth:`process_weights_after_loading` repacks once;
    :meth:`apply` runs per forward.
    """

    @abstractmethod
    def create_weights(
        self, layer: torch.nn.Module, input_size: int, output_sizes: list[int], bias: bool, dtype: torch.dtype
    ) -> None:
        """Register parameters on ``layer`` for a [sum(output_sizes), input_size] weight."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Repack loaded weights (a no-op by default)."""

    @abstractmethod
    def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x: [T, input_size] -> [T, sum(output_sizes)] in x's dtype, bias included."""


class Quantizer(ABC):
    """A quantization method.

    - ``name``: registry key, matched against ``quantization_config.quant_method``.
    - ``supported_platforms``: platform names, or None for any.
    - ``activation_dtypes``: compute dtype names it accepts.
    - ``error_bound``: the largest relative error of a quantized linear layer's
      output against the unquantized one that the method promises.
    """

    name: ClassVar[str]
    supported_platforms: ClassVar[frozenset[str] | None] = None
    activation_dtypes: ClassVar[frozenset[str]] = frozenset({"bfloat16", "float32"})
    error_bound: ClassVar[float] = 0.0

    @classmethod
    @abstractmethod
    def from_config(cls, quantization_config: dict[str, Any]) -> Quantizer:
        """Build from a checkpoint's ``quantization_config`` (``{}`` for on-the-fly)."""

    @abstractmethod
    def get_linear_method(self, layer_name: str) -> LinearMethod | None:
        """The method for the linear layer ``layer_name``, or None to leave it unquantized."""
