from __future__ import annotations

import torch

from engine.interfaces.attention import MHA, SLIDING_WINDOW
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
    for kind in (MHA, SLIDING_WINDOW):
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
