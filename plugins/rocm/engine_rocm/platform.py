"""The AMD GPU platform: ROCm/HIP devices, which torch exposes under the device type ``cuda``."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from functools import cached_property
from typing import TYPE_CHECKING

from engine.interfaces.attention import LINEAR, MAMBA2, MHA, MLA, SLIDING_WINDOW
from engine.interfaces.platform import Availability, TorchCudaPlatform
from engine_rocm.arch import ArchCapabilities, arch_capabilities, fp8_capable_archs, is_fp8_method
from engine_rocm.detect import aiter_importable, device_arch, probe_availability

if TYPE_CHECKING:
    from engine.interfaces.ops import LayerOps


class DeviceFp8Dtype:
    """``fp8_dtype`` of :class:`RocmPlatform`. The FP8 format depends on the device, so the class
    answers None (as the base class does: nothing is known before a device is probed) and an
    instance answers the format of device 0's architecture (``RocmPlatform.arch``)."""

    def __get__(self, instance: RocmPlatform | None, owner: type | None = None) -> str | None:
        if instance is None:
            return None
        return instance.arch.fp8_dtype


class RocmPlatform(TorchCudaPlatform):
    """AMD Instinct and Radeon GPUs through a ROCm build of torch.

    Available when ``torch.version.hip`` is set and ``torch.cuda.device_count() > 0``;
    ``HIP_VISIBLE_DEVICES``, ``ROCR_VISIBLE_DEVICES`` and ``CUDA_VISIBLE_DEVICES`` set to an
    empty list or ``-1`` hide every device, and the reason names the variable.

    Device-dependent answers are read from device 0 on first use and kept per instance:
    ``arch`` (gfx target, family, FP8 format, see ``engine_rocm.arch``) and ``fp8_dtype``
    (``float8_e4m3fnuz`` on gfx942, ``float8_e4m3fn`` on gfx950 and gfx12xx, None elsewhere;
    None when read on the class). These, and every method that needs the device, raise
    ``RuntimeError`` with the availability reason on a platform that is not available.

    Attention: with AMD's ``aiter`` package importable (and ``ENGINE_ROCM_AITER`` not ``0``)
    the AITER backends of ``aiter_attention_backends`` come first, then the engine's built-in
    Triton backends of ``attention_backends``. Preferences need no device.
    """

    name = "rocm"
    device_type = "cuda"  # torch's name for HIP devices
    dist_backend = "nccl"  # RCCL, under torch.distributed's nccl name
    supported_dtypes = ("float32", "bfloat16", "float16")
    default_dtype = "bfloat16"
    fp8_dtype = DeviceFp8Dtype()  # type: ignore[assignment]
    attention_backends = {
        MHA: ("triton_paged",),
        SLIDING_WINDOW: ("triton_paged",),
        MLA: ("triton_mla",),
        LINEAR: ("triton_kda",),
        MAMBA2: ("triton_mamba2",),
    }
    # engine-rocm's AITER backends (engine_rocm.aiter_attention); MLA stays on triton_mla
    aiter_attention_backends: Mapping[str, tuple[str, ...]] = {MHA: ("aiter_mha",), SLIDING_WINDOW: ("aiter_mha",)}

    @classmethod
    def is_available(cls) -> Availability:
        return probe_availability()

    # device state, probed once per instance (availability: TorchCudaPlatform)

    @cached_property
    def arch(self) -> ArchCapabilities:
        """Architecture of device 0 and what the engine takes from it."""
        self.require_available()
        return arch_capabilities(device_arch(0))

    @cached_property
    def aiter_available(self) -> bool:
        return aiter_importable()

    # capabilities

    def attention_backend_preferences(self, kind: str) -> tuple[str, ...]:
        """AITER's backend for ``kind`` when aiter imports, then the built-in Triton backend."""
        aiter = tuple(self.aiter_attention_backends.get(kind, ())) if self.aiter_available else ()
        return (*aiter, *super().attention_backend_preferences(kind))

    def layer_ops(self, dtype: str) -> LayerOps | None:
        """Group-quantized linear layers through the engine's Triton kernel
        (``engine.kernels.group_quant``) where Triton is installed; None (the torch reference
        ops) without it. Needs no device."""
        if importlib.util.find_spec("triton") is None:
            return None
        from engine.kernels.group_quant import TritonLayerOps

        return TritonLayerOps()

    def check_quantization(self, method: str) -> None:
        """Besides the base check, refuse FP8 methods (names containing ``fp8``) on a device
        without FP8 (``ValueError``); needs the device only for such methods."""
        super().check_quantization(method)
        if is_fp8_method(method) and not self.arch.has_fp8:
            raise ValueError(
                f"{method} needs an FP8-capable AMD GPU ({fp8_capable_archs()}); this device is "
                f"{self.arch.arch} ({self.arch.family}). Serve an unquantized checkpoint or one "
                f"quantized without FP8."
            )
