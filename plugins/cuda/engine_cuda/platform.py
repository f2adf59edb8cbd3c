"""The NVIDIA GPU platform: CUDA devices through a CUDA build of torch."""

from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING, Any

from engine.interfaces.attention import LINEAR, MHA, MLA, SLIDING_WINDOW
from engine.interfaces.platform import Availability, MemoryInfo, Platform
from engine_cuda.capability import CudaCapability
from engine_cuda.detect import device_capability, probe_availability

if TYPE_CHECKING:
    import torch

ALL_DTYPES = ("float32", "bfloat16", "float16")


class ByDevice:
    """A capability answer that depends on device 0: read on the class it is ``on_class``
    (what the platform may offer on some device: nothing is known before a device is probed),
    read on an instance it is ``CudaPlatform.capability``'s ``field``."""

    def __init__(self, field: str, on_class: Any) -> None:
        self.field, self.on_class = field, on_class

    def __get__(self, instance: CudaPlatform | None, owner: type | None = None) -> Any:
        if instance is None:
            return self.on_class
        return getattr(instance.capability, self.field)


class CudaPlatform(Platform):
    """NVIDIA GPUs through a CUDA build of torch.

    Available when torch is a CUDA build (not ROCm) and ``torch.cuda.is_available()`` with
    device 0 of compute capability 7.5 or newer; ``CUDA_VISIBLE_DEVICES`` set to an empty list
    or ``-1`` hides every device, and the reason names it; otherwise the reason is the CUDA
    runtime's own (no driver, a driver older than torch's CUDA).

    Device-dependent answers are read from device 0 on first use and kept per instance
    (``capability``, see ``engine_cuda.capability``): ``supported_dtypes`` (bfloat16 from
    compute capability 8.0), ``default_dtype`` (bfloat16 there, float16 before) and
    ``fp8_dtype`` (``float8_e4m3fn`` from 8.9). Read on the class they give what some device
    may offer. These, and every method that needs the device, raise ``RuntimeError`` with the
    availability reason on a platform that is not available; attention preferences need no device.
    """

    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    async_scheduling_default = True  # the host plans step N + 1 while the GPU runs step N
    supported_dtypes = ByDevice("dtypes", ALL_DTYPES)  # type: ignore[assignment]
    default_dtype = ByDevice("default_dtype", "bfloat16")  # type: ignore[assignment]
    fp8_dtype = ByDevice("fp8_dtype", None)  # type: ignore[assignment]
    attention_backends = {
        MHA: ("triton_paged",),
        SLIDING_WINDOW: ("triton_paged",),
        MLA: ("triton_mla",),
        LINEAR: ("triton_kda",),
    }

    @classmethod
    def is_available(cls) -> Availability:
        return probe_availability()

    # device state, probed once per instance

    @cached_property
    def availability(self) -> Availability:
        return type(self).is_available()

    def require_available(self) -> None:
        """Raise ``RuntimeError`` with the reason when no NVIDIA GPU can be used."""
        availability = self.availability
        if not availability:
            raise RuntimeError(f"Platform {self.name!r} is not available: {availability.reason}")

    @cached_property
    def capability(self) -> CudaCapability:
        """Compute capability of device 0 and what the engine takes from it."""
        self.require_available()
        return device_capability(0)

    # device

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

    def device_graphs(self):
        """CUDA graphs (``engine_cuda.graphs``), the decode steps' captures sharing one pool."""
        from engine_cuda.graphs import CudaGraphs

        self.require_available()
        return CudaGraphs()

    def seed_everything(self, seed: int) -> None:
        """Seed Python, NumPy and torch, and the generators of every visible GPU."""
        import torch

        self.require_available()
        super().seed_everything(seed)
        torch.cuda.manual_seed_all(seed)

    def synchronize(self) -> None:
        import torch

        torch.cuda.synchronize(self.device())
