"""The optional attention libraries engine-cuda prefers where they import and are recent
enough: FlashInfer (``flashinfer``, 0.2 or newer: the plan / run wrappers) and flash-attn
(``flash_attn``, 2.3 or newer: bottom-right causal masks and ``window_size``). Each can be
switched off (``ENGINE_CUDA_FLASHINFER=0``, ``ENGINE_CUDA_FLASH_ATTN=0``). Probing never
raises: an installed library that fails to import, or is too old, is logged as a warning
and passed over for the engine's Triton backends."""

from __future__ import annotations

import importlib
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType

logger = logging.getLogger("engine.cuda")


@dataclass(frozen=True)
class Library:
    module: str
    package: str  # what pip installs
    min_version: tuple[int, ...]
    needs: str  # the attribute the backend calls
    switch: str  # the environment variable that turns it off

    def describe_min(self) -> str:
        return ".".join(map(str, self.min_version))


FLASHINFER = Library(
    "flashinfer", "flashinfer-python", (0, 2), "BatchPrefillWithPagedKVCacheWrapper", "ENGINE_CUDA_FLASHINFER"
)
FLASH_ATTN = Library("flash_attn", "flash-attn", (2, 3), "flash_attn_varlen_func", "ENGINE_CUDA_FLASH_ATTN")
OFF = ("0", "false", "no", "off")


def parse_version(text: str) -> tuple[int, ...]:
    """``"2.7.4.post1"`` -> (2, 7, 4); what cannot be read is (0,)."""
    numbers = re.match(r"\s*v?(\d+(?:\.\d+)*)", text or "")
    return tuple(int(n) for n in numbers.group(1).split(".")) if numbers else (0,)


def load(library: Library) -> ModuleType:
    """The library's module, or a ``RuntimeError`` that says what is wrong and what to do."""
    try:
        module = importlib.import_module(library.module)
    except ImportError as exc:
        raise RuntimeError(
            f"{library.module} cannot be imported ({exc}): pip install {library.package} (built for this "
            f"torch and CUDA), or choose --attention-backend triton_paged"
        ) from exc
    version = getattr(module, "__version__", "")
    if parse_version(version) < library.min_version:
        raise RuntimeError(
            f"{library.module} {version or '(no version)'} is older than {library.describe_min()}, the least "
            f"engine-cuda's backend runs on: upgrade {library.package}"
        )
    if not hasattr(module, library.needs):
        raise RuntimeError(f"{library.module} {version} has no {library.needs}: upgrade {library.package}")
    return module


def usable(library: Library, environ: Mapping[str, str] | None = None) -> bool:
    """Whether the library's backend is preferred: switched on, importable and recent enough."""
    environ = os.environ if environ is None else environ
    if environ.get(library.switch, "1").strip().lower() in OFF:
        return False
    try:
        load(library)
    except RuntimeError as exc:
        cause = exc.__cause__
        if not (isinstance(cause, ModuleNotFoundError) and cause.name == library.module):  # installed, unusable
            logger.warning("%s; using the Triton backends", exc)
        return False
    except Exception as exc:  # an installed library whose import fails in another way
        logger.warning("%s is installed but cannot be imported (%s: %s)", library.module, type(exc).__name__, exc)
        return False
    return True
