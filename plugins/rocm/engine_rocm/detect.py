"""Finding AMD GPUs through torch's HIP runtime, and the optional AITER kernels. torch and
aiter are imported inside the functions, never at module import."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from engine.interfaces.platform import Availability
from engine_rocm.arch import arch_capabilities, gfx_arch

logger = logging.getLogger("engine")

# HIP honours all three (CUDA_VISIBLE_DEVICES for CUDA compatibility); ROCR_ filters at the
# runtime level below HIP. Each is a comma-separated list of ordinals (or, for ROCR_, UUIDs).
VISIBILITY_VARIABLES = ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")

AITER_SWITCH = "ENGINE_ROCM_AITER"


def hides_all_devices(value: str) -> bool:
    """Whether a visibility list leaves no device: an empty list, or one whose first entry is
    a negative ordinal (HIP stops reading the list at the first invalid ordinal, so ``-1``
    and ``-1,0`` both hide everything)."""
    first = value.split(",", 1)[0].strip()
    if not first:
        return True
    try:
        return int(first) < 0
    except ValueError:  # a UUID (GPU-...) selects a device
        return False


def hidden_by_environment(environ: Mapping[str, str]) -> str | None:
    """``NAME='value'`` of the first visibility variable that hides every device, else None."""
    for variable in VISIBILITY_VARIABLES:
        value = environ.get(variable)
        if value is not None and hides_all_devices(value):
            return f"{variable}={value!r}"
    return None


def probe_availability(environ: Mapping[str, str] | None = None) -> Availability:
    """Available when torch is a HIP build and sees at least one device. Never raises: a failing
    probe becomes ``Availability(False, reason)``. The reason of an available platform names
    the device count, device 0 and its architecture, and the HIP version."""
    environ = os.environ if environ is None else environ
    try:
        import torch
    except Exception as exc:
        return Availability(False, f"torch cannot be imported: {type(exc).__name__}: {exc}")
    try:
        hip = getattr(torch.version, "hip", None)
        if not hip:
            cuda = getattr(torch.version, "cuda", None)
            build = (
                f"; this torch is built for CUDA {cuda}"
                if cuda
                else f"; this torch ({torch.__version__}) has no GPU runtime"
            )
            return Availability(False, f"torch has no HIP runtime (torch.version.hip is None){build}")
        hidden = hidden_by_environment(environ)
        if hidden is not None:
            return Availability(False, f"no AMD GPU visible ({hidden})")
        count = torch.cuda.device_count()
        if count <= 0:
            return Availability(False, f"no AMD GPU visible (torch.cuda.device_count() is 0; HIP {hip})")
        properties = torch.cuda.get_device_properties(0)
        caps = arch_capabilities(getattr(properties, "gcnArchName", ""))
        plural = "s" if count != 1 else ""
        device = f"device 0: {properties.name} ({caps.arch}, {caps.family})"
        return Availability(True, f"{count} AMD GPU{plural} visible; {device}; HIP {hip}")
    except Exception as exc:
        return Availability(False, f"probing AMD GPUs failed: {type(exc).__name__}: {exc}")


def device_arch(index: int = 0) -> str:
    """The gfx target of device ``index`` without feature flags (``"gfx942"``)."""
    import torch

    return gfx_arch(getattr(torch.cuda.get_device_properties(index), "gcnArchName", ""))


def aiter_importable(environ: Mapping[str, str] | None = None) -> bool:
    """Whether AMD's AITER kernels can be used: ``aiter`` imports, has what ``aiter_mha`` calls,
    and ``ENGINE_ROCM_AITER`` is not ``0``. Never raises; an installed aiter that fails to import is logged as a warning."""
    environ = os.environ if environ is None else environ
    if environ.get(AITER_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    try:
        import aiter
    except ModuleNotFoundError as exc:
        if exc.name != "aiter":
            logger.warning("aiter is installed but cannot be imported (%s); using the Triton backends", exc)
        return False
    except Exception as exc:
        logger.warning(
            "aiter is installed but cannot be imported (%s: %s); using the Triton backends", type(exc).__name__, exc
        )
        return False
    if not hasattr(aiter, "flash_attn_varlen_func"):  # what engine_rocm.aiter_attention calls
        logger.warning(
            "this aiter (%s) has no flash_attn_varlen_func; using the Triton backends",
            getattr(aiter, "__version__", "unknown version"),
        )
        return False
    return True
