"""Detection with faked probes: availability and its reasons, visibility variables, the
architecture of device 0, FP8 format and quantization checks, forced selection."""

from __future__ import annotations

import pytest
import torch

from engine.cli import main
from engine.plugins.manager import get_plugin_manager
from engine.selection import SelectionError, select_platform
from engine_rocm.platform import RocmPlatform

HIP_VERSION = "6.3.42131"  # as conftest.fake_rocm installs it
NO_HIP = "torch has no HIP runtime (torch.version.hip is None)"


# available


@pytest.mark.parametrize(
    "gcn_arch_name, arch, family, fp8_dtype",
    [
        ("gfx942:sramecc+:xnack-", "gfx942", "CDNA3", "float8_e4m3fnuz"),
        ("gfx950:sramecc+:xnack-", "gfx950", "CDNA4", "float8_e4m3fn"),
        ("gfx1200", "gfx1200", "RDNA4", "float8_e4m3fn"),
        ("gfx1201", "gfx1201", "RDNA4", "float8_e4m3fn"),
        ("gfx1100", "gfx1100", "RDNA3", None),
        ("gfx90a:sramecc+:xnack-", "gfx90a", "CDNA2", None),
    ],
)
def test_detected_architecture_and_fp8_format(fake_rocm, gcn_arch_name, arch, family, fp8_dtype):
    fake_rocm(gcn_arch_name, gcn_arch_name)
    availability = RocmPlatform.is_available()
    assert availability.available
    assert availability.reason == (
        f"2 AMD GPUs visible; device 0: AMD Radeon Graphics 0 ({arch}, {family}); HIP {HIP_VERSION}"
    )
    platform = RocmPlatform()
    assert (platform.arch.arch, platform.arch.family) == (arch, family)
    assert platform.fp8_dtype == fp8_dtype
    assert RocmPlatform.fp8_dtype is None  # the class cannot know the device


@pytest.mark.parametrize("gcn_arch_name", ["gfx942:sramecc+:xnack-", "gfx950", "gfx1200", "gfx1201"])
def test_fp8_quantization_is_accepted_on_fp8_devices(fake_rocm, gcn_arch_name):
    fake_rocm(gcn_arch_name)
    platform = RocmPlatform()
    platform.check_quantization("fp8")
    platform.check_quantization("ptpc_fp8")
    platform.check_quantization("bitsandbytes")


@pytest.mark.parametrize(
    "gcn_arch_name, arch, family",
    [
        ("gfx1100", "gfx1100", "RDNA3"),
        ("gfx90a:sramecc+:xnack-", "gfx90a", "CDNA2"),
    ],
)
def test_fp8_quantization_is_refused_without_fp8(fake_rocm, gcn_arch_name, arch, family):
    fake_rocm(gcn_arch_name)
    platform = RocmPlatform()
    with pytest.raises(ValueError) as refused:
        platform.check_quantization("fp8")
    assert str(refused.value).startswith(
        f"fp8 needs an FP8-capable AMD GPU (gfx942, gfx950, gfx12xx); this device is {arch} ({family})."
    )
    with pytest.raises(ValueError, match=f"^ptpc_fp8 needs an FP8-capable AMD GPU .*{arch}"):
        platform.check_quantization("ptpc_fp8")
    platform.check_quantization("bitsandbytes")  # not FP8: accepted


def test_architecture_is_read_from_device_0(fake_rocm):
    read = fake_rocm("gfx942:sramecc+:xnack-", "gfx90a:sramecc+:xnack-")
    read.clear()
    platform = RocmPlatform()
    assert platform.arch.arch == "gfx942"
    assert read and set(read) == {0}
    reads = len(read)
    assert platform.fp8_dtype == "float8_e4m3fnuz"
    assert len(read) == reads  # probed once per instance


@pytest.mark.parametrize(
    "variable, value",
    [
        ("HIP_VISIBLE_DEVICES", "1"),
        ("ROCR_VISIBLE_DEVICES", "0,1"),
        ("ROCR_VISIBLE_DEVICES", "GPU-4b2c1f0e9d8a7b6c"),
    ],
)
def test_visibility_lists_that_select_devices_keep_the_platform_available(fake_rocm, monkeypatch, variable, value):
    fake_rocm("gfx942", "gfx942")
    monkeypatch.setenv(variable, value)
    assert RocmPlatform.is_available().available


# not available


def test_torch_without_hip(fake_rocm):
    fake_rocm("gfx942", hip=None)
    availability = RocmPlatform.is_available()
    assert not availability.available
    assert availability.reason.startswith(NO_HIP)


def test_cuda_build_of_torch_is_named(fake_rocm, monkeypatch):
    fake_rocm("gfx942", hip=None)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert RocmPlatform.is_available().reason == f"{NO_HIP}; this torch is built for CUDA 12.8"


@pytest.mark.parametrize("variable", ["HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"])
@pytest.mark.parametrize("value", ["", "-1", "-1,0", " "])
def test_visibility_variables_that_hide_every_device(fake_rocm, monkeypatch, variable, value):
    fake_rocm("gfx942", "gfx942")  # devices exist; the variable hides them
    monkeypatch.setenv(variable, value)
    availability = RocmPlatform.is_available()
    assert not availability.available
    assert availability.reason == f"no AMD GPU visible ({variable}={value!r})"


def test_no_device(fake_rocm):
    fake_rocm()
    availability = RocmPlatform.is_available()
    assert not availability.available
    assert availability.reason == f"no AMD GPU visible (torch.cuda.device_count() is 0; HIP {HIP_VERSION})"


@pytest.mark.parametrize("broken", ["device_count", "get_device_properties"])
def test_a_failing_probe_becomes_a_reason(fake_rocm, monkeypatch, broken):
    fake_rocm("gfx942")

    def fail(*args):
        raise RuntimeError("HIP error: no ROCm-capable device is detected")

    monkeypatch.setattr(torch.cuda, broken, fail)
    availability = RocmPlatform.is_available()
    assert not availability.available
    assert availability.reason == "probing AMD GPUs failed: RuntimeError: HIP error: no ROCm-capable device is detected"


def test_device_methods_raise_the_reason_when_unavailable(fake_rocm, monkeypatch):
    fake_rocm("gfx942")
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "")
    platform = RocmPlatform()  # constructing needs no device
    message = r"^Platform 'rocm' is not available: no AMD GPU visible \(HIP_VISIBLE_DEVICES=''\)$"
    for use in (
        platform.device,
        platform.memory_info,
        platform.synchronize,
        platform.default_kv_cache_bytes,
        lambda: platform.seed_everything(0),
        lambda: platform.allocate_kv_cache((2, 4), torch.float16),
        lambda: platform.arch,
        lambda: platform.fp8_dtype,
        lambda: platform.check_quantization("fp8"),
    ):
        with pytest.raises(RuntimeError, match=message):
            use()
    platform.check_quantization("bitsandbytes")  # needs no device
    assert platform.attention_backend_preferences("mha")  # nor do preferences


# forcing and probing from the command line


def test_forcing_rocm_without_hardware_names_the_reason(fake_rocm):
    fake_rocm("gfx942", hip=None)
    platforms = get_plugin_manager(["rocm"]).components().platforms
    with pytest.raises(SelectionError) as refused:
        select_platform(platforms, "rocm")
    assert str(refused.value).startswith(f"Platform 'rocm' is not available: {NO_HIP}")


def test_rocm_is_chosen_over_cpu_when_available(fake_rocm):
    fake_rocm("gfx942")
    platforms = get_plugin_manager(["rocm", "cpu"]).components().platforms
    assert type(select_platform(platforms, None)) is RocmPlatform
    assert type(select_platform(platforms, "rocm")) is RocmPlatform


def test_cpu_is_chosen_when_rocm_is_hidden(fake_rocm, monkeypatch):
    fake_rocm("gfx942")
    monkeypatch.setenv("ROCR_VISIBLE_DEVICES", "-1")
    platforms = get_plugin_manager(["rocm", "cpu"]).components().platforms
    assert select_platform(platforms, None).name == "cpu"


def test_engine_plugins_probe_prints_the_reason(fake_rocm, monkeypatch, capsys):
    fake_rocm("gfx1100")
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "")
    assert main(["plugins", "--plugins", "rocm", "--probe"]) == 0
    assert "platform rocm: not available (no AMD GPU visible (HIP_VISIBLE_DEVICES=''))" in capsys.readouterr().out
    monkeypatch.delenv("HIP_VISIBLE_DEVICES")
    assert main(["plugins", "--plugins", "rocm", "--probe"]) == 0
    assert (
        f"platform rocm: available (1 AMD GPU visible; device 0: AMD Radeon Graphics 0 (gfx1100, RDNA3); "
        f"HIP {HIP_VERSION})"
    ) in capsys.readouterr().out
