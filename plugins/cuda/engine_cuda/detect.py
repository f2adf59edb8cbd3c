"""Finding NVIDIA GPUs through torch's CUDA runtime. torch is imported inside the functions,
never at module import."""

from __future__ import annotations

import os
from collections.abc import Mapping

from engine.interfaces.platform import Availability
from engine_cuda.capability import MIN_CAPABILITY, CudaCapability

VISIBILITY_VARIABLE = "CUDA_VISIBLE_DEVICES"


def hides_all_devices(value: str) -> bool:
    """Whether a ``CUDA_VISIBLE_DEVICES`` list leaves no device: an empty list, or one whose
    first entry is a negative ordinal (CUDA stops reading the list at the first invalid entry,
    so ``-1`` and ``-1,0`` both hide everything). UUIDs (``GPU-...``, ``MIG-...``) select devices."""
    first = value.split(",", 1)[0].strip()
    if not first:
        return True
    try:
        return int(first) < 0
    except ValueError:
        return False


def probe_availability(environ: Mapping[str, str] | None = None) -> Availability:
    """Available when torch is a CUDA build that sees at least one device of a supported
    compute capability. Never raises: every failure becomes ``Availability(False, reason)``,
    a reason a user can act on (no CUDA torch, devices hidden, no or too old a driver, too
    old a GPU). The reason of an available platform names the device count, device 0 with its
    compute capability, and the CUDA version torch was built with."""
    environ = os.environ if environ is None else environ
    try:
        import torch
    except Exception as exc:
        return Availability(False, f"torch cannot be imported: {type(exc).__name__}: {exc}")
    try:
        hip = getattr(torch.version, "hip", None)
        if hip:
            return Availability(False, f"this torch is a ROCm build (HIP {hip}): AMD GPUs are engine-rocm's platform")
        cuda = getattr(torch.version, "cuda", None)
        if not cuda:
            return Availability(
                False,
                f"torch has no CUDA runtime (torch {torch.__version__} is a CPU build); install a CUDA build "
                "of torch (pytorch.org, Get Started)",
            )
        value = environ.get(VISIBILITY_VARIABLE)
        if value is not None and hides_all_devices(value):
            return Availability(False, f"no NVIDIA GPU visible ({VISIBILITY_VARIABLE}={value!r})")
        if not torch.cuda.is_available():
            return Availability(False, _why_unavailable(torch, cuda))
        count = torch.cuda.device_count()
        if count <= 0:
            return Availability(False, f"no NVIDIA GPU visible (torch.cuda.device_count() is 0; CUDA {cuda})")
        capability = CudaCapability(*torch.cuda.get_device_capability(0))
        name = torch.cuda.get_device_name(0)
        if not capability.supported:
            need = f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}"
            return Availability(
                False,
                f"device 0 ({name}) has {capability.describe()}; the engine's Triton kernels need compute "
                f"capability {need} (Turing) or newer",
            )
        plural = "s" if count != 1 else ""
        return Availability(
            True, f"{count} NVIDIA GPU{plural} visible; device 0: {name} ({capability.describe()}); CUDA {cuda}"
        )
    except Exception as exc:
        return Availability(False, f"probing NVIDIA GPUs failed: {type(exc).__name__}: {exc}")


def _why_unavailable(torch, cuda: str) -> str:
    """torch.cuda.is_available() is False: the runtime's own words (no driver, a driver older
    than this torch's CUDA, no device), from initialising it."""
    try:
        torch.cuda.init()
    except Exception as exc:
        message = " ".join(str(exc).split())
        return f"the CUDA {cuda} runtime cannot start: {message}"
    return f"no NVIDIA GPU visible (torch.cuda.is_available() is False; CUDA {cuda})"


def device_capability(index: int = 0) -> CudaCapability:
    import torch

    return CudaCapability(*torch.cuda.get_device_capability(index))
