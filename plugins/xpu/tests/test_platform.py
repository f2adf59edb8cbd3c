"""The xpu platform's availability, reasons and device calls, with ``torch.xpu`` faked
(no Intel GPU here), and its selection by the engine."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.interfaces.attention import LINEAR, MAMBA2, MHA, MLA, SLIDING_WINDOW
from engine.plugins.manager import get_plugin_manager
from engine.selection import SelectionError, select_platform
from engine_xpu.platform import XpuPlatform
from engine_xpu.quantizer import Mxfp8Quantizer

GIB = 2**30


@pytest.fixture
def fake_gpu(monkeypatch):
    """Two visible Intel GPUs behind ``torch.xpu``; records the device calls made."""
    calls = []
    xpu = torch.xpu
    monkeypatch.setattr(xpu, "is_available", lambda: True)
    monkeypatch.setattr(xpu, "device_count", lambda: 2)
    monkeypatch.setattr(xpu, "get_device_name", lambda index=0: "Intel(R) Data Center GPU Max 1550")
    monkeypatch.setattr(xpu, "mem_get_info", lambda index=0: (40 * GIB, 64 * GIB))
    monkeypatch.setattr(xpu, "manual_seed_all", lambda seed: calls.append(("manual_seed_all", seed)))
    monkeypatch.setattr(xpu, "synchronize", lambda device=None: calls.append(("synchronize",)))
    return calls


def test_registers_the_platform_and_the_quantizer():
    components = get_plugin_manager(["xpu"]).components()
    assert components.platforms.get("xpu") is XpuPlatform
    assert components.quantizers.get("mxfp8") is Mxfp8Quantizer


def test_declared_capabilities():
    assert (XpuPlatform.device_type, XpuPlatform.dist_backend) == ("xpu", "xccl")
    assert XpuPlatform.supported_dtypes == ("float32", "bfloat16", "float16")
    platform = XpuPlatform()  # no device needed for preferences
    assert platform.attention_backend_preferences(MHA) == ("triton_paged",)
    assert platform.attention_backend_preferences(SLIDING_WINDOW) == ("triton_paged",)
    assert platform.attention_backend_preferences(MLA) == ("triton_mla",)
    assert platform.attention_backend_preferences(LINEAR) == ("triton_kda",)
    assert platform.attention_backend_preferences(MAMBA2) == ("triton_mamba2",)


def test_unavailable_without_torch_xpu(monkeypatch):
    monkeypatch.delattr(torch, "xpu")
    availability = XpuPlatform.is_available()
    assert not availability
    assert availability.reason == "torch has no XPU support (torch.xpu missing)"


def test_unavailable_without_a_visible_device(monkeypatch):
    monkeypatch.setattr(torch.xpu, "is_available", lambda: False)
    availability = XpuPlatform.is_available()
    assert not availability
    assert availability.reason.startswith("no Intel GPU visible (torch.xpu.is_available() is False)")


def test_the_reason_says_when_torch_was_built_without_xpu(monkeypatch):
    monkeypatch.setattr(torch.xpu, "is_available", lambda: False)
    monkeypatch.setattr(torch._C, "_has_xpu", False, raising=False)
    assert "built without XPU support" in XpuPlatform.is_available().reason
    monkeypatch.setattr(torch._C, "_has_xpu", True, raising=False)
    reason = XpuPlatform.is_available().reason
    assert "built without" not in reason and "ZE_AFFINITY_MASK" in reason


def test_a_failing_probe_is_an_answer_not_an_exception(monkeypatch):
    def broken():
        raise RuntimeError("level zero driver missing")

    monkeypatch.setattr(torch.xpu, "is_available", broken)
    availability = XpuPlatform.is_available()
    assert not availability and "level zero driver missing" in availability.reason


def test_available_with_a_device_names_it(fake_gpu):
    availability = XpuPlatform.is_available()
    assert availability
    assert availability.reason == "2 Intel GPU(s): Intel(R) Data Center GPU Max 1550"


def test_device_calls_go_to_torch_xpu(fake_gpu):
    platform = XpuPlatform()
    assert platform.device() == torch.device("xpu", 0)
    assert platform.device(1) == torch.device("xpu", 1)
    assert platform.memory_info().free_bytes == 40 * GIB and platform.memory_info().total_bytes == 64 * GIB
    platform.seed_everything(7)
    assert fake_gpu and set(fake_gpu) == {("manual_seed_all", 7)}  # torch.manual_seed also seeds the XPUs
    platform.synchronize()
    assert fake_gpu[-1] == ("synchronize",)
    # and the host generators are seeded too
    first = torch.rand(3)
    platform.seed_everything(7)
    assert torch.equal(first, torch.rand(3))


def test_memory_info_falls_back_to_the_device_properties(fake_gpu, monkeypatch):
    def no_query(index=0):
        raise RuntimeError("mem_get_info is not supported by this driver")

    monkeypatch.setattr(torch.xpu, "mem_get_info", no_query)
    monkeypatch.setattr(torch.xpu, "get_device_properties", lambda index=0: SimpleNamespace(total_memory=64 * GIB))
    monkeypatch.setattr(torch.xpu, "memory_reserved", lambda index=0: 3 * GIB)
    info = XpuPlatform().memory_info()
    assert (info.free_bytes, info.total_bytes) == (61 * GIB, 64 * GIB)


def test_device_methods_raise_with_the_reason_when_unavailable(monkeypatch):
    monkeypatch.setattr(torch.xpu, "is_available", lambda: False)
    platform = XpuPlatform()
    for call in (
        platform.memory_info,
        platform.device,
        lambda: platform.seed_everything(0),
        platform.synchronize,
        lambda: platform.allocate_kv_cache((2, 4), torch.float32),
    ):
        with pytest.raises(RuntimeError, match=r"Platform 'xpu' is not available: no Intel GPU visible"):
            call()


def test_forcing_the_platform_where_it_is_unavailable_fails_with_the_reason(monkeypatch):
    monkeypatch.setattr(torch.xpu, "is_available", lambda: False)
    platforms = get_plugin_manager(["xpu", "cpu"]).components().platforms
    with pytest.raises(SelectionError, match=r"Platform 'xpu' is not available: no Intel GPU visible"):
        select_platform(platforms, "xpu")
    assert select_platform(platforms, None).name == "cpu"


def test_an_available_intel_gpu_is_chosen_over_the_cpu(fake_gpu):
    platforms = get_plugin_manager(["xpu", "cpu"]).components().platforms
    assert isinstance(select_platform(platforms, None), XpuPlatform)
    assert isinstance(select_platform(platforms, "xpu"), XpuPlatform)
