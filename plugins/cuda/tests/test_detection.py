"""Detection with faked probes: availability and its reasons, CUDA_VISIBLE_DEVICES, the
compute capability of device 0 and what follows from it, forced and automatic selection."""

from __future__ import annotations

import logging

import pytest
import torch
from cuda_fakes import A100, B200, CUDA_VERSION, H100, L4, T4, V100

from engine.cli import main
from engine.plugins.manager import get_plugin_manager
from engine.selection import SelectionError, resolve_dtype, select_platform
from engine_cuda.platform import CudaPlatform

# available


@pytest.mark.parametrize(
    "device, description, dtypes, default, fp8",
    [
        (H100, "compute capability 9.0, Hopper", ("float32", "bfloat16", "float16"), "bfloat16", "float8_e4m3fn"),
        (B200, "compute capability 10.0, Blackwell", ("float32", "bfloat16", "float16"), "bfloat16", "float8_e4m3fn"),
        (L4, "compute capability 8.9, Ada Lovelace", ("float32", "bfloat16", "float16"), "bfloat16", "float8_e4m3fn"),
        (A100, "compute capability 8.0, Ampere", ("float32", "bfloat16", "float16"), "bfloat16", None),
        (T4, "compute capability 7.5, Turing", ("float32", "float16"), "float16", None),
    ],
)
def test_detected_device_and_what_follows_from_its_capability(fake_cuda, device, description, dtypes, default, fp8):
    fake_cuda(device, device)
    availability = CudaPlatform.is_available()
    assert availability.available
    assert availability.reason == f"2 NVIDIA GPUs visible; device 0: {device[0]} ({description}); CUDA {CUDA_VERSION}"
    platform = CudaPlatform()
    assert platform.supported_dtypes == dtypes
    assert platform.default_dtype == default
    assert platform.fp8_dtype == fp8
    assert platform.supports_dtype("float16") and platform.supports_dtype("bfloat16") == ("bfloat16" in dtypes)
    # the class cannot know the device: what some device may offer
    assert CudaPlatform.supported_dtypes == ("float32", "bfloat16", "float16")
    assert CudaPlatform.fp8_dtype is None


def test_bf16_is_refused_before_ampere_and_auto_takes_fp16(fake_cuda):
    fake_cuda(T4)
    platform = CudaPlatform()
    with pytest.raises(
        SelectionError,
        match=r"^dtype bfloat16 is not supported on platform 'cuda'; supported: "
        r"float32, float16\.$",
    ):
        resolve_dtype("bfloat16", None, platform)
    assert resolve_dtype("auto", "bfloat16", platform) == "float16"  # a bf16 checkpoint runs in fp16 there
    assert resolve_dtype("auto", "float32", platform) == "float32"


def test_capability_is_read_from_device_0_once_per_instance(fake_cuda):
    read = fake_cuda(H100, T4)
    read.clear()
    platform = CudaPlatform()
    assert platform.capability.version == (9, 0)
    assert read and set(read) == {0}
    reads = len(read)
    assert platform.default_dtype == "bfloat16" and platform.fp8_dtype == "float8_e4m3fn"
    assert len(read) == reads


@pytest.mark.parametrize("value", ["1", "0,1", "GPU-4b2c1f0e-9d8a-7b6c-5d4e-3f2a1b0c9d8e", "MIG-1f2e3d4c"])
def test_visibility_lists_that_select_devices_keep_the_platform_available(fake_cuda, monkeypatch, value):
    fake_cuda(H100, H100)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    assert CudaPlatform.is_available().available


# not available


def test_cpu_build_of_torch(fake_cuda):
    fake_cuda(H100, cuda=None)
    availability = CudaPlatform.is_available()
    assert not availability.available
    assert availability.reason == (
        f"torch has no CUDA runtime (torch {torch.__version__} is a CPU build); install a CUDA build of torch "
        "(pytorch.org, Get Started)"
    )


def test_rocm_build_of_torch_points_at_engine_rocm(fake_cuda, monkeypatch):
    fake_cuda(H100)
    monkeypatch.setattr(torch.version, "hip", "6.3.42131")
    assert CudaPlatform.is_available().reason == (
        "this torch is a ROCm build (HIP 6.3.42131): AMD GPUs are engine-rocm's platform"
    )


@pytest.mark.parametrize("value", ["", "-1", "-1,0", " "])
def test_cuda_visible_devices_that_hide_every_device(fake_cuda, monkeypatch, value):
    fake_cuda(H100, H100)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    availability = CudaPlatform.is_available()
    assert not availability.available
    assert availability.reason == f"no NVIDIA GPU visible (CUDA_VISIBLE_DEVICES={value!r})"


def test_a_driver_too_old_is_reported_in_the_runtimes_words(fake_cuda):
    message = (
        "The NVIDIA driver on your system is too old (found version 11040).\n Please update your GPU driver by "
        "downloading and installing a new version from the URL: http://www.nvidia.com/Download/index.aspx"
    )
    fake_cuda(H100, init_error=message)
    availability = CudaPlatform.is_available()
    assert not availability.available
    assert availability.reason == (
        f"the CUDA {CUDA_VERSION} runtime cannot start: The NVIDIA driver on your system is too old (found version "
        "11040). Please update your GPU driver by downloading and installing a new version from the URL: "
        "http://www.nvidia.com/Download/index.aspx"
    )


def test_no_driver(fake_cuda):
    fake_cuda(H100, init_error="Found no NVIDIA driver on your system. Please check that you have an NVIDIA GPU")
    assert CudaPlatform.is_available().reason == (
        f"the CUDA {CUDA_VERSION} runtime cannot start: Found no NVIDIA driver on your system. Please check that "
        "you have an NVIDIA GPU"
    )


def test_no_device(fake_cuda):
    fake_cuda()
    availability = CudaPlatform.is_available()
    assert not availability.available
    assert availability.reason == f"no NVIDIA GPU visible (torch.cuda.is_available() is False; CUDA {CUDA_VERSION})"


def test_a_gpu_older_than_turing_is_refused_with_its_capability(fake_cuda):
    fake_cuda(V100)
    availability = CudaPlatform.is_available()
    assert not availability.available
    assert availability.reason == (
        "device 0 (Tesla V100-SXM2-16GB) has compute capability 7.0, Volta; the engine's Triton kernels need "
        "compute capability 7.5 (Turing) or newer"
    )


@pytest.mark.parametrize("broken", ["device_count", "get_device_capability", "get_device_name"])
def test_a_failing_probe_becomes_a_reason(fake_cuda, monkeypatch, broken):
    fake_cuda(H100)

    def fail(*args):
        raise RuntimeError("CUDA error: unspecified launch failure")

    monkeypatch.setattr(torch.cuda, broken, fail)
    availability = CudaPlatform.is_available()
    assert not availability.available
    assert availability.reason == "probing NVIDIA GPUs failed: RuntimeError: CUDA error: unspecified launch failure"


def test_device_methods_raise_the_reason_when_unavailable(fake_cuda, monkeypatch):
    fake_cuda(H100)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    platform = CudaPlatform()  # constructing needs no device
    message = r"^Platform 'cuda' is not available: no NVIDIA GPU visible \(CUDA_VISIBLE_DEVICES=''\)$"
    for use in (
        platform.device,
        platform.memory_info,
        platform.synchronize,
        platform.default_kv_cache_bytes,
        lambda: platform.seed_everything(0),
        lambda: platform.allocate_kv_cache((2, 4), torch.float16),
        lambda: platform.capability,
        lambda: platform.supported_dtypes,
        lambda: platform.fp8_dtype,
    ):
        with pytest.raises(RuntimeError, match=message):
            use()
    assert platform.attention_backend_preferences("mha") == ("triton_paged",)  # needs no device
    assert platform.attention_backend_preferences("mla") == ("triton_mla",)
    assert platform.attention_backend_preferences("linear") == ("triton_kda",)
    assert platform.attention_backend_preferences("mamba2") == ("triton_mamba2",)


# forcing, choosing and probing from the command line


def test_forcing_cuda_without_hardware_names_the_reason(fake_cuda):
    fake_cuda(H100, cuda=None)
    platforms = get_plugin_manager(["cuda"]).components().platforms
    with pytest.raises(SelectionError) as refused:
        select_platform(platforms, "cuda")
    assert str(refused.value).startswith("Platform 'cuda' is not available: torch has no CUDA runtime")


def test_an_available_gpu_is_chosen_over_the_cpu_and_the_choice_is_logged(fake_cuda, caplog):
    fake_cuda(H100)
    platforms = get_plugin_manager(["cuda", "cpu", "rocm"]).components().platforms
    with caplog.at_level(logging.INFO, logger="engine"):
        assert type(select_platform(platforms, None)) is CudaPlatform
    chosen = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "platform" in r.getMessage()]
    assert chosen and chosen[-1].startswith(
        f"platform cuda chosen: 1 NVIDIA GPU visible; device 0: {H100[0]} (compute capability 9.0, Hopper)"
    )
    assert "passed over: cpu (available; an accelerator is preferred, --device cpu to use it)" in chosen[-1]
    assert "rocm (torch has no HIP runtime" in chosen[-1]
    assert type(select_platform(platforms, "cuda")) is CudaPlatform
    assert select_platform(platforms, "cpu").name == "cpu"  # only by asking


def test_cpu_is_chosen_when_every_gpu_is_hidden(fake_cuda, monkeypatch, caplog):
    fake_cuda(H100)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    platforms = get_plugin_manager(["cuda", "cpu"]).components().platforms
    with caplog.at_level(logging.INFO, logger="engine"):
        assert select_platform(platforms, None).name == "cpu"
    assert any(
        r.getMessage().startswith("platform cpu chosen:")
        and "passed over: cuda (no NVIDIA GPU visible (CUDA_VISIBLE_DEVICES='-1'))" in r.getMessage()
        for r in caplog.records
    )


def test_engine_plugins_probe_prints_the_reason(fake_cuda, monkeypatch, capsys):
    fake_cuda(L4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert main(["plugins", "--plugins", "cuda", "--probe"]) == 0
    assert "platform cuda: not available (no NVIDIA GPU visible (CUDA_VISIBLE_DEVICES=''))" in capsys.readouterr().out
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert main(["plugins", "--plugins", "cuda", "--probe"]) == 0
    assert (
        f"platform cuda: available (1 NVIDIA GPU visible; device 0: NVIDIA L4 (compute capability 8.9, Ada Lovelace); "
        f"CUDA {CUDA_VERSION})"
    ) in capsys.readouterr().out
