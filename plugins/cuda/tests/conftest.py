"""Faked CUDA probes: a CUDA build of torch with chosen devices, on any machine."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))

from cuda_fakes import CUDA_VERSION  # noqa: E402

from engine_cuda.detect import VISIBILITY_VARIABLE


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    """No visibility variable leaks in from the machine running the tests."""
    monkeypatch.delenv(VISIBILITY_VARIABLE, raising=False)


@pytest.fixture
def fake_cuda(monkeypatch):
    """``fake_cuda((name, (major, minor)), ...)`` makes torch a CUDA build that sees those
    devices; returns the list of device indices whose capability was read. ``init_error``
    makes the runtime fail to start with that message (torch.cuda.is_available() then False)."""

    def install(*devices: tuple[str, tuple[int, int]], cuda: str | None = CUDA_VERSION, init_error: str | None = None):
        read: list[int] = []

        def get_device_capability(index=0):
            read.append(index)
            return devices[index][1]

        def init():
            if init_error is not None:
                raise RuntimeError(init_error)

        monkeypatch.setattr(torch.version, "hip", None)
        monkeypatch.setattr(torch.version, "cuda", cuda)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: init_error is None and bool(devices))
        monkeypatch.setattr(torch.cuda, "init", init)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 0 if init_error is not None else len(devices))
        monkeypatch.setattr(torch.cuda, "get_device_capability", get_device_capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: devices[index][0])
        return read

    return install
