"""engine-cpu through the plugin conformance kit (engine.testing.kit)."""

from __future__ import annotations

from engine.testing.kit import AttentionBackendTests, PlatformTests


# attention backend
class TestCpuPagedAttentionKit(AttentionBackendTests):
    plugin = "cpu"
    backend_name = "cpu_paged"
    dtypes = ("float32", "bfloat16")


class TestCpuMlaAttentionKit(AttentionBackendTests):
    plugin = "cpu"
    backend_name = "cpu_mla"
    dtypes = ("float32", "bfloat16")


class TestCpuIndexerKit(AttentionBackendTests):
    plugin = "cpu"
    backend_name = "cpu_indexer"
    dtypes = ("float32", "bfloat16")


class TestCpuKdaKit(AttentionBackendTests):
    plugin = "cpu"
    backend_name = "cpu_kda"
    dtypes = ("float32", "bfloat16")


class TestCpuMamba2Kit(AttentionBackendTests):
    plugin = "cpu"
    backend_name = "cpu_mamba2"
    dtypes = ("float32", "bfloat16")


# platform


class TestCpuPlatformKit(PlatformTests):
    plugin = "cpu"
    platform_name = "cpu"
