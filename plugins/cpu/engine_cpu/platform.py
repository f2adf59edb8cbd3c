"""The CPU platform."""

from __future__ import annotations

import os

from engine.interfaces.attention import INDEXER, LINEAR, MAMBA2, MHA, MLA, SLIDING_WINDOW, SPARSE_MLA
from engine.interfaces.platform import Availability, MemoryInfo, Platform

DEFAULT_KV_CACHE_CAP = 4 * 2**30


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    supported_dtypes = ("float32", "bfloat16", "float16")
    default_dtype = "bfloat16"
    # float16 matmuls are very slow on CPUs without native fp16 arithmetic
    auto_dtype_overrides = {"float16": "bfloat16"}
    attention_backends = {
        MHA: ("cpu_paged",),
        SLIDING_WINDOW: ("cpu_paged",),
        MLA: ("cpu_mla",),
        SPARSE_MLA: ("cpu_mla",),
        INDEXER: ("cpu_indexer",),
        LINEAR: ("cpu_kda",),
        MAMBA2: ("cpu_mamba2",),
    }

    @classmethod
    def is_available(cls) -> Availability:
        return Availability(True, f"{os.cpu_count()} logical CPUs")

    def memory_info(self) -> MemoryInfo:
        return read_meminfo()

    def configure_process(self) -> None:
        tune_malloc()

    def linear_method(self, dtype: str):
        from engine_cpu import native
        from engine_cpu.linear import DECODE_COPY_FRACTION, OneDNNLinearMethod, decode_gemv_enabled, onednn_available

        # bf16 only: the packed fp32 path reorders the accumulation, and fp32 serves as the exact reference
        if dtype != "bfloat16" or not onednn_available():
            return None
        kernels = native.load() if decode_gemv_enabled() else None
        if kernels is None or not kernels.gemv_supported():
            return OneDNNLinearMethod()
        budget = int(self.memory_info().total_bytes * DECODE_COPY_FRACTION)
        return OneDNNLinearMethod(kernels, copy_budget_bytes=budget)

    def batch_invariant_linear_method(self, dtype: str):
        from engine_cpu import native
        from engine_cpu.linear import DECODE_COPY_FRACTION, BatchInvariantGemvLinearMethod, DotLinearMethod

        kernels = native.load()
        # without the kernels (or in float16) the engine runs each layer one row at a time
        if kernels is None or dtype not in ("bfloat16", "float32"):
            return None
        if dtype == "bfloat16" and kernels.gemv_supported():
            return BatchInvariantGemvLinearMethod(
                kernels, copy_budget_bytes=int(self.memory_info().total_bytes * DECODE_COPY_FRACTION)
            )
        return DotLinearMethod(kernels)

    def layer_ops(self, dtype: str):
        from engine_cpu import native
        from engine_cpu.ops import NativeLayerOps

        kernels = native.load()
        return NativeLayerOps(kernels) if kernels is not None else None

    def device_graphs(self):
        """Recorded decode forwards (``engine_cpu.graphs``), captured by the first decode step of
        each batch size; none without the native kernels (the torch attention path sizes its
        decode work by the step's longest sequence, which a graph fixes at ``max_model_len``)."""
        from engine_cpu import native
        from engine_cpu.graphs import CpuGraph

        return CpuGraph if native.load() is not None else None

    def allocate_kv_cache(self, shape, dtype):
        from engine_cpu.memory import huge_page_zeros

        return huge_page_zeros(tuple(shape), dtype)

    def default_kv_cache_bytes(self) -> int:
        # the cache is zero-filled host memory shared with everything else on the machine
        return min(self.memory_info().free_bytes // 2, DEFAULT_KV_CACHE_CAP)


# glibc serves allocations above M_MMAP_THRESHOLD (at most 32 MiB by default) with
# fresh mmaps, so every large activation of a prefill step page-faults its memory
# in again; keeping them in the heap halves the time of elementwise ops there.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3


def tune_malloc() -> bool:
    """Keep large freed blocks for reuse (``ENGINE_CPU_MALLOC_TUNING=0`` disables).
    Returns whether glibc accepted the settings."""
    if os.environ.get("ENGINE_CPU_MALLOC_TUNING", "1") in ("0", "false", "False"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 1 << 31))
    except (OSError, AttributeError):  # not glibc
        return False


def read_meminfo(path: str = "/proc/meminfo") -> MemoryInfo:
    """Available and total system memory; falls back to sysconf where /proc is absent."""
    try:
        fields = {}
        with open(path, encoding="ascii") as f:
            for line in f:
                key, _, rest = line.partition(":")
                fields[key] = int(rest.split()[0]) * 1024
        return MemoryInfo(free_bytes=fields["MemAvailable"], total_bytes=fields["MemTotal"])
    except (OSError, KeyError, ValueError, IndexError):
        page = os.sysconf("SC_PAGE_SIZE")
        return MemoryInfo(
            free_bytes=os.sysconf("SC_AVPHYS_PAGES") * page, total_bytes=os.sysconf("SC_PHYS_PAGES") * page
        )
