from __future__ import annotations

import torch

from engine.interfaces.attention import MHA, MLA, SLIDING_WINDOW
from engine.plugins.manager import get_plugin_manager
from engine_cpu.platform import CpuPlatform, read_meminfo, tune_malloc


def test_cpu_platform_is_available_and_registered():
    components = get_plugin_manager(["cpu"]).components()
    assert components.platforms.get("cpu") is CpuPlatform
    availability = CpuPlatform.is_available()
    assert availability and availability.reason


def test_declared_dtypes_work():
    platform = CpuPlatform()
    for name in platform.supported_dtypes:
        x = torch.ones(4, 4, dtype=getattr(torch, name), device=platform.device())
        assert (x @ x).sum().item() == 64


def test_backend_preferences_resolve_to_registered_backends():
    components = get_plugin_manager(["cpu"]).components()
    for kind in (MHA, SLIDING_WINDOW, MLA):
        assert CpuPlatform().attention_backend_preferences(kind), kind
        for name in CpuPlatform().attention_backend_preferences(kind):
            assert kind in components.attention_backends.get(name).capabilities.kinds


def test_meminfo_parsing(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:         1000 kB\nMemAvailable:   20000000 kB\n")
    info = read_meminfo(str(meminfo))
    assert info.total_bytes == 24000000 * 1024
    assert info.free_bytes == 20000000 * 1024


def test_seed_everything_makes_torch_reproducible():
    platform = CpuPlatform()
    platform.seed_everything(123)
    a = torch.rand(3)
    platform.seed_everything(123)
    assert torch.equal(a, torch.rand(3))


def test_cpu_malloc_tuning_is_accepted_and_can_be_disabled(monkeypatch):
    assert tune_malloc() is True
    monkeypatch.setenv("ENGINE_CPU_MALLOC_TUNING", "0")
    assert tune_malloc() is False


def test_kv_cache_is_zeroed_and_advised_onto_huge_pages(monkeypatch):
    from engine_cpu import memory

    calls = []

    def fake_madvise(address, length, advice):
        calls.append((address, length, advice))
        return 0

    monkeypatch.setattr(memory, "_madvise", lambda: fake_madvise)
    shape = (2, 300, 16, 4, 64)  # 4.9 MB of bf16
    cache = CpuPlatform().allocate_kv_cache(shape, torch.bfloat16)
    assert cache.shape == shape and cache.dtype == torch.bfloat16 and cache.is_contiguous()
    assert not cache.any()
    ((address, length, advice),) = calls
    assert advice == memory.MADV_HUGEPAGE
    assert address % memory.HUGE_PAGE == 0 and address == cache.data_ptr()
    assert length == cache.numel() * 2 // memory.HUGE_PAGE * memory.HUGE_PAGE
    # small buffers and a disabled switch get plain memory
    calls.clear()
    assert not CpuPlatform().allocate_kv_cache((2, 4, 16, 4, 64), torch.bfloat16).any()
    assert calls == []


def test_huge_pages_can_be_turned_off(monkeypatch):
    from engine_cpu import memory

    memory._madvise.cache_clear()
    monkeypatch.setenv("ENGINE_CPU_HUGE_PAGES", "0")
    try:
        assert memory._madvise() is None
        assert not memory.huge_page_zeros((4, 1 << 20), torch.float32).any()
    finally:
        memory._madvise.cache_clear()


def test_default_platform_allocation_is_plain_zeros():
    from engine.interfaces.platform import Platform

    cache = Platform.allocate_kv_cache(CpuPlatform(), (2, 3, 4), torch.float32)
    assert torch.equal(cache, torch.zeros(2, 3, 4))


def test_no_onednn_bf16_path_means_plain_linear_layers(monkeypatch):
    """torch's oneDNN refuses to pack bf16 weights on a CPU without AVX512 (BW/VL/DQ) or
    AVX-NE-CONVERT; the platform must then leave linear layers to F.linear instead of failing
    at load. The probe is faked here, so the fallback is checked on every CPU."""
    from engine_cpu import linear

    def refuse(weight, groups):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx512bw")

    linear.onednn_available.cache_clear()
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse, raising=False)
    try:
        assert not linear.onednn_available()
        assert CpuPlatform().linear_method("bfloat16") is None
    finally:
        linear.onednn_available.cache_clear()
