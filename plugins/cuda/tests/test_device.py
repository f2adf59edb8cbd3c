"""Device methods on a faked CUDA device: torch.cuda's calls receive the platform's device."""

from __future__ import annotations

import pytest
import torch
from cuda_fakes import H100

from engine.interfaces.platform import MemoryInfo
from engine_cuda.platform import CudaPlatform


@pytest.fixture
def platform(fake_cuda):
    fake_cuda(H100)
    return CudaPlatform()


def test_declared_capabilities():
    assert CudaPlatform.name == "cuda"
    assert CudaPlatform.device_type == "cuda"
    assert CudaPlatform.dist_backend == "nccl"
    assert CudaPlatform.supported_dtypes == ("float32", "bfloat16", "float16")


def test_device_is_a_torch_cuda_device(platform):
    assert platform.device() == torch.device("cuda", 0)
    assert platform.device(3) == torch.device("cuda", 3)


def test_memory_info_and_default_kv_cache(platform, monkeypatch):
    asked = []

    def mem_get_info(device=None):
        asked.append(device)
        return 3 << 30, 80 << 30

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    assert platform.memory_info() == MemoryInfo(free_bytes=3 << 30, total_bytes=80 << 30)
    assert platform.default_kv_cache_bytes() == 3 << 29
    assert asked == [torch.device("cuda", 0)] * 2


def test_memory_stats_read_the_caching_allocator_of_the_device(platform, monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: calls.append(("now", device)) or 5 << 20)
    monkeypatch.setattr(
        torch.cuda, "max_memory_allocated", lambda device=None: calls.append(("peak", device)) or 9 << 20
    )
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.append(("reset", device)))
    platform.reset_peak_memory()
    assert platform.memory_stats() == (5 << 20, 9 << 20)
    device = torch.device("cuda", 0)
    assert calls == [("reset", device), ("now", device), ("peak", device)]


def test_seed_everything_seeds_every_gpu_and_the_host(platform, monkeypatch):
    seeds = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", seeds.append)
    platform.seed_everything(1234)
    first = torch.rand(4)
    platform.seed_everything(1234)
    assert torch.equal(first, torch.rand(4))
    assert seeds and set(seeds) == {1234}


def test_synchronize_waits_on_the_device(platform, monkeypatch):
    synchronized = []
    monkeypatch.setattr(torch.cuda, "synchronize", synchronized.append)
    platform.synchronize()
    assert synchronized == [torch.device("cuda", 0)]
