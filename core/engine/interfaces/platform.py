"""The Platform interface: one hardware target."""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, ClassVar, Mapping

if TYPE_CHECKING:
    import torch

    from engine.interfaces.ops import LayerOps
    from engine.interfaces.quantizer import LinearMethod


@dataclass(frozen=True)
class Availability:
    """Answer of :meth:`Platform.is_available`: ``reason`` says why not (or what was found)."""

    available: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.available


@dataclass(frozen=True)
class MemoryInfo:
    free_bytes: int
    total_bytes: int


class Platform(ABC):
    """A hardware target. Exactly one platform is active in an engine.

    Capabilities are class attributes so that selection code, ``engine plugins``
    and the conformance kit read them without instantiating anything or
    importing torch:

    - ``name``: registry key (``--device NAME``).
    - ``device_type``: the torch device type (``"cpu"``, ``"cuda"``, ``"xpu"``).
    - ``dist_backend``: ``torch.distributed`` backend (gloo, nccl, xccl).
    - ``supported_dtypes``: torch dtype names usable for compute (``"bfloat16"``).
    - ``default_dtype``: used when the user asks for ``auto`` and the checkpoint's
      dtype is not supported.
    - ``auto_dtype_overrides``: checkpoint dtype -> dtype ``auto`` picks instead
      (for a dtype that works but is slow here).
    - ``fp8_dtype``: name of the native FP8 dtype, or None.
    - ``attention_backends``: attention kind -> backend names in order of preference.
    - ``supported_quantizations``: quantization method names, or None for any.
    - ``async_scheduling_default``: whether ``--async-scheduling`` is on when not given (the
      forward on a thread of its own while the host schedules the next step: a gain where a
      device runs the forward, a loss where the host's cores do).

    Instances take no constructor arguments. Methods raise ``RuntimeError`` with a
    reason when used on a platform that is not available.
    """

    name: ClassVar[str]
    device_type: ClassVar[str]
    dist_backend: ClassVar[str]
    supported_dtypes: ClassVar[tuple[str, ...]]
    default_dtype: ClassVar[str] = "bfloat16"
    fp8_dtype: ClassVar[str | None] = None
    auto_dtype_overrides: ClassVar[Mapping[str, str]] = {}
    attention_backends: ClassVar[Mapping[str, tuple[str, ...]]] = {}
    supported_quantizations: ClassVar[tuple[str, ...] | None] = None
    async_scheduling_default: ClassVar[bool] = False

    @classmethod
    @abstractmethod
    def is_available(cls) -> Availability:
        """Probe the hardware. Never raises: failures become ``Availability(False, reason)``."""

    @abstractmethod
    def memory_info(self) -> MemoryInfo:
        """Free and total memory of the device, in bytes."""

    def configure_process(self) -> None:
        """Process-wide settings the platform wants (allocator, threads), applied once
        by an engine right after it selects this platform. A no-op by default."""

    def linear_method(self, dtype: str) -> LinearMethod | None:
        """A faster method for unquantized linear layers in ``dtype`` (e.g. prepacked
        weights), applied to a model after its weights are loaded; None keeps
        ``torch.nn.functional.linear``. Its outputs must match ``F.linear``'s within
        the dtype's rounding."""
        return None

    def batch_invariant_linear_method(self, dtype: str) -> LinearMethod | None:
        """A method for unquantized linear layers whose every output row is bitwise the same
        whatever rows share the call (``--batch-invariant``: the order of each row's sums fixed,
        not chosen by the row count); it sets ``batch_invariant = True``. None: the engine runs
        :meth:`linear_method`'s method (or ``F.linear``) one row at a time, correct everywhere
        and slow."""
        return None

    def layer_ops(self, dtype: str) -> LayerOps | None:
        """Fused elementwise layer operations (RMSNorm with residual add, RoPE,
        SiLU-and-mul) for ``dtype``, subclassing :class:`engine.interfaces.ops.LayerOps`
        and matching it up to the dtype's rounding; None keeps the torch reference."""
        return None

    def memory_stats(self) -> tuple[int, int] | None:
        """``(allocated, peak)``: the bytes the device allocator's live tensors hold now and
        their peak since :meth:`reset_peak_memory`; None (the default, the CPU's answer) where
        the platform cannot tell. Where it can, the KV cache is sized by
        ``--gpu-memory-utilization`` and a profiled forward (``engine.engine.memory_plan``)."""
        return None

    def reset_peak_memory(self) -> None:
        """Start :meth:`memory_stats`' peak afresh (a no-op where it answers None)."""

    def device_graphs(self):
        """A factory of device graphs (``engine.runtime.graphs.DeviceGraph``: ``capture(fn)``
        records ``fn``'s kernels and returns its output, ``replay()`` reruns them into it), with
        which the engine captures its decode steps at start-up, or with ``capture_on_first_use``
        set on the factory, by the first decode step of each batch size (``capture`` may then
        raise ``engine.runtime.graphs.UncapturableStep``); None (the default) where the
        platform has none, and every step runs eagerly."""
        return None

    def default_kv_cache_bytes(self) -> int:
        """KV-cache size when the user sets none: half of the free memory by default."""
        return self.memory_info().free_bytes // 2

    def allocate_kv_cache(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """One layer's KV cache: a zero-filled, contiguous tensor of ``shape`` (the
        attention backend's ``kv_cache_shape``) on ``self.device()``. A platform may
        place it where its kernels read it fastest (engine-cpu asks for huge pages).
        Called once per layer at start-up."""
        import torch

        return torch.zeros(shape, dtype=dtype, device=self.device())

    def device(self, index: int = 0) -> torch.device:
        import torch

        if self.device_type == "cpu":
            return torch.device("cpu")
        return torch.device(self.device_type, index)

    def supports_dtype(self, dtype: str) -> bool:
        return dtype in self.supported_dtypes

    def attention_backend_preferences(self, kind: str) -> tuple[str, ...]:
        """Backend names to try for an attention kind, best first (empty if none)."""
        return tuple(self.attention_backends.get(kind, ()))

    def check_quantization(self, method: str) -> None:
        """Raise ``ValueError`` when ``method`` cannot run on this platform."""
        allowed = self.supported_quantizations
        if allowed is not None and method not in allowed:
            raise ValueError(
                f"Quantization {method!r} is not supported on platform {self.name!r}. "
                f"Supported: {', '.join(allowed) or 'none'}."
            )

    def seed_everything(self, seed: int) -> None:
        """Seed Python, NumPy and torch (and the device's generators)."""
        import numpy as np
        import torch

        random.seed(seed)
        np.random.seed(seed % (2**32))
        torch.manual_seed(seed)

    def synchronize(self) -> None:
        """Wait for queued device work to finish (a no-op on synchronous devices)."""


class TorchCudaPlatform(Platform):
    """The device side of a platform driven through ``torch.cuda`` (CUDA and ROCm builds of
    torch both expose their GPUs there): availability probed once per instance, and the
    device, its memory (``mem_get_info``, the caching allocator's counters), seeding and
    synchronisation. Every method that needs the device first raises ``RuntimeError`` with the
    availability reason on a platform that is not available."""

    @cached_property
    def availability(self) -> Availability:
        return type(self).is_available()

    def require_available(self) -> None:
        """Raise ``RuntimeError`` with the reason when no device of this platform can be used."""
        availability = self.availability
        if not availability:
            raise RuntimeError(f"Platform {self.name!r} is not available: {availability.reason}")

    def device(self, index: int = 0) -> torch.device:
        import torch

        self.require_available()
        return torch.device(self.device_type, index)

    def memory_info(self) -> MemoryInfo:
        import torch

        free_bytes, total_bytes = torch.cuda.mem_get_info(self.device())
        return MemoryInfo(free_bytes=int(free_bytes), total_bytes=int(total_bytes))

    def memory_stats(self) -> tuple[int, int]:
        """The caching allocator's live bytes on the device and their peak since the last reset."""
        import torch

        device = self.device()
        return int(torch.cuda.memory_allocated(device)), int(torch.cuda.max_memory_allocated(device))

    def reset_peak_memory(self) -> None:
        import torch

        torch.cuda.reset_peak_memory_stats(self.device())

    def seed_everything(self, seed: int) -> None:
        """Seed Python, NumPy and torch, and the generators of every visible GPU."""
        import torch

        self.require_available()
        super().seed_everything(seed)
        torch.cuda.manual_seed_all(seed)

    def synchronize(self) -> None:
        import torch

        torch.cuda.synchronize(self.device())
