"""The NVIDIA GPU platform: CUDA devices through a CUDA build of torch."""

from __future__ import annotations

import importlib.util
from functools import cached_property
from typing import TYPE_CHECKING, Any

from engine.interfaces.attention import LINEAR, MAMBA2, MHA, MLA, SLIDING_WINDOW
from engine.interfaces.platform import Availability, TorchCudaPlatform
from engine_cuda.attention_libraries import FLASH_ATTN, FLASHINFER, Library, usable
from engine_cuda.capability import CudaCapability
from engine_cuda.detect import device_capability, probe_availability

if TYPE_CHECKING:
    from engine.interfaces.ops import LayerOps

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


class CudaPlatform(TorchCudaPlatform):
    """NVIDIA GPUs through a CUDA build of torch.

    Available when torch is a CUDA build (not ROCm) and ``torch.cuda.is_available()`` with
    device 0 of compute capability 7.5 or newer; ``CUDA_VISIBLE_DEVICES`` set to an empty list
    or ``-1`` hides every device, and the reason names it; otherwise the reason is the CUDA
    runtime's own (no driver, a driver older than torch's CUDA).

    Attention: FlashInfer's and flash-attn's backends first where those libraries import and
    are recent enough (``engine_cuda.attention_libraries``), then the engine's Triton backends.

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
        MAMBA2: ("triton_mamba2",),
    }
    # the optional libraries' backends, first where they import and are recent enough
    # (engine_cuda.attention_libraries), FlashInfer before flash-attn: it reads the paged cache
    # in place, flash-attn's varlen call reads a gathered copy
    library_attention_backends: dict[str, tuple[tuple[Library, str], ...]] = {
        MHA: ((FLASHINFER, "flashinfer"), (FLASH_ATTN, "flash_attn")),
        SLIDING_WINDOW: ((FLASHINFER, "flashinfer"), (FLASH_ATTN, "flash_attn")),
    }

    @classmethod
    def is_available(cls) -> Availability:
        return probe_availability()

    def attention_backend_preferences(self, kind: str) -> tuple[str, ...]:
        """FlashInfer's and flash-attn's backends for ``kind`` where those libraries are usable,
        then the engine's Triton backend. Needs no device."""
        libraries = tuple(name for library, name in self.library_attention_backends.get(kind, ()) if usable(library))
        return (*libraries, *super().attention_backend_preferences(kind))

    def layer_ops(self, dtype: str) -> LayerOps | None:
        """Group-quantized linear layers through the engine's Triton kernel
        (``engine.kernels.group_quant``) and FP8 products through engine-cuda's Triton GEMM
        (``engine_cuda.layer_ops``) where Triton is installed; None (the torch reference ops)
        without it. Needs no device."""
        if importlib.util.find_spec("triton") is None:
            return None
        from engine_cuda.layer_ops import CudaLayerOps

        return CudaLayerOps()

    # device state, probed once per instance (availability: TorchCudaPlatform)

    @cached_property
    def capability(self) -> CudaCapability:
        """Compute capability of device 0 and what the engine takes from it."""
        self.require_available()
        return device_capability(0)

    # device (memory, seeding, synchronisation: TorchCudaPlatform)

    def device_graphs(self):
        """CUDA graphs (``engine_cuda.graphs``), the decode steps' captures sharing one pool."""
        from engine_cuda.graphs import CudaGraphs

        self.require_available()
        return CudaGraphs()
