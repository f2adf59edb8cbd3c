"""The C++ kernels of engine-cpu, compiled on first use with the system compiler.

The build is cached by torch (``TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``) and rebuilt when the source changes. Where no
compiler works, :func:`load` returns None and callers use their torch path.
``ENGINE_CPU_NATIVE=0`` disables the kernels.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from types import ModuleType

logger = logging.getLogger("engine.cpu")

CSRC = Path(__file__).parent / "csrc"
SOURCES = [
    CSRC / name
    for name in (
        "paged_attention.cpp",
        "packed_attention.cpp",
        "prefill_attention.cpp",
        "layer_ops.cpp",
        "gemv.cpp",
        "dot_linear.cpp",
    )
]


@functools.lru_cache(maxsize=None)
def load() -> ModuleType | None:
    if os.environ.get("ENGINE_CPU_NATIVE", "1") in ("0", "false", "False"):
        return None
    try:
        from torch.utils.cpp_extension import load as load_extension

        logger.info("building engine-cpu kernels (first use only)")
        return load_extension(
            name="engine_cpu_kernels",
            sources=[str(path) for path in SOURCES],
            extra_include_paths=[str(CSRC)],
            # -fopenmp: at::parallel_for is inline and runs serially in code compiled without it
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math", "-fno-finite-math-only"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # no compiler, or headers missing
        logger.warning("engine-cpu kernels unavailable, using the torch attention path: %s", exc)
        return None
