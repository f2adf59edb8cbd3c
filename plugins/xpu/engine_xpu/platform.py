"""The Intel GPU platform (torch device type ``xpu``).

Everything goes through ``torch.xpu``, present in torch's XPU builds (and, with
``is_available()`` False, in its other builds). Attention runs on the engine's
built-in Triton backends; torch's XPU wheels ship Triton for Intel GPUs.
"""

from __future__ import annotations

import importlib.util
from functools import cached_property
from types import ModuleType
from typing import TYPE_CHECKING

from engine.interfaces.attention import LINEAR, MAMBA2, MHA, MLA, SLIDING_WINDOW
from engine.interfaces.platform import Availability, MemoryInfo, Platform

if TYPE_CHECKING:
    import torch

    from engine.interfaces.ops import LayerOps


def probe() -> Availability:
    """Whether torch sees an Intel GPU, and which. Never raises."""
    try:
        import torch
    except Exception as exc:  # a broken torch install must not break platform selection
        return Availability(False, f"torch cannot be imported: {type(exc).__name__}: {exc}")
    xpu = getattr(torch, "xpu", None)
    if xpu is None:
        return Availability(False, "torch has no XPU support (torch.xpu missing)")
    try:
        available = bool(xpu.is_available())
    except Exception as exc:
        return Availability(False, f"probing for an Intel GPU failed: {type(exc).__name__}: {exc}")
    if not available:
        reason = "no Intel GPU visible (torch.xpu.is_available() is False)"
        if getattr(torch._C, "_has_xpu", True):
            reason += (
                "; check that the Intel GPU driver (Level Zero) is installed and that ONEAPI_DEVICE_SELECTOR "
                "or ZE_AFFINITY_MASK does not hide the devices"
            )
        else:
            reason += f"; torch {torch.__version__} was built without XPU support: install an XPU build of torch"
        return Availability(False, reason)
    try:
        count = int(xpu.device_count())
        names = sorted({xpu.get_device_name(index) for index in range(count)})
    except Exception as exc:
        return Availability(True, f"an Intel GPU is visible (its name could not be read: {exc})")
    return Availability(True, f"{count} Intel GPU(s): {', '.join(names)}")


class XpuPlatform(Platform):
    """Intel GPUs (Data Center GPU Max, Arc) through an XPU build of torch.

    Available when ``torch.xpu.is_available()``; the reason names the devices, or says
    why not (no ``torch.xpu``, no device visible, a torch built without XPU). Every
    method that needs the device raises ``RuntimeError`` with that reason on a platform
    that is not available; capabilities and preferences need no device.
    """

    name = "xpu"
    device_type = "xpu"
    dist_backend = "xccl"
    supported_dtypes = ("float32", "bfloat16", "float16")
    default_dtype = "bfloat16"
    # the engine's built-in Triton backends
    attention_backends = {
        MHA: ("triton_paged",),
        SLIDING_WINDOW: ("triton_paged",),
        MLA: ("triton_mla",),
        LINEAR: ("triton_kda",),
        MAMBA2: ("triton_mamba2",),
    }

    @classmethod
    def is_available(cls) -> Availability:
        return probe()

    def layer_ops(self, dtype: str) -> LayerOps | None:
        """Group-quantized linear layers through the engine's Triton kernel
        (``engine.kernels.group_quant``) where Triton is installed; None (the torch reference
        ops) without it. Needs no device."""
        if importlib.util.find_spec("triton") is None:
            return None
        from engine.kernels.group_quant import TritonLayerOps

        return TritonLayerOps()

    @cached_property
    def availability(self) -> Availability:
        return type(self).is_available()

    def _xpu(self) -> ModuleType:
        """``torch.xpu``; raises ``RuntimeError`` with the reason when no Intel GPU is usable."""
        import torch

        availability = self.availability
        if not availability:
            raise RuntimeError(f"Platform {self.name!r} is not available: {availability.reason}")
        return torch.xpu

    def memory_info(self) -> MemoryInfo:
        """Free and total memory of device 0: the driver's numbers where torch offers
        ``mem_get_info``, else the device's total less what torch's allocator reserved."""
        xpu = self._xpu()
        try:
            free, total = xpu.mem_get_info(0)
        except (AttributeError, RuntimeError):  # older torch, or a driver without the free-memory query
            total = xpu.get_device_properties(0).total_memory
            free = total - xpu.memory_reserved(0)
        return MemoryInfo(free_bytes=int(free), total_bytes=int(total))

    def device(self, index: int = 0) -> torch.device:
        import torch

        self._xpu()
        return torch.device("xpu", index)

    def seed_everything(self, seed: int) -> None:
        """Seed Python, NumPy and torch, and the generators of every visible Intel GPU."""
        xpu = self._xpu()
        super().seed_everything(seed)
        xpu.manual_seed_all(seed)

    def synchronize(self) -> None:
        self._xpu().synchronize()
