"""Faked ROCm probes: a HIP build of torch with chosen devices, on any machine."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from engine_rocm.detect import AITER_SWITCH, VISIBILITY_VARIABLES

HIP_VERSION = "6.3.42131"


@dataclass
class FakeDeviceProperties:
    """The fields of torch.cuda.get_device_properties that engine-rocm reads."""

    name: str
    gcnArchName: str  # torch's spelling


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    """No visibility variable or AITER switch leaks in from the machine running the tests."""
    for variable in (*VISIBILITY_VARIABLES, AITER_SWITCH):
        monkeypatch.delenv(variable, raising=False)


@pytest.fixture
def fake_rocm(monkeypatch):
    """``fake_rocm(*gcn_arch_names)`` makes torch a HIP build that sees one device per name;
    returns the list of device indices whose properties were read."""

    def install(*gcn_arch_names: str, hip: str | None = HIP_VERSION) -> list[int]:
        devices = [FakeDeviceProperties(f"AMD Radeon Graphics {i}", arch) for i, arch in enumerate(gcn_arch_names)]
        read: list[int] = []

        def get_device_properties(index=0):
            read.append(index)
            return devices[index]

        monkeypatch.setattr(torch.version, "hip", hip)
        monkeypatch.setattr(torch.version, "cuda", None)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(devices))
        monkeypatch.setattr(torch.cuda, "get_device_properties", get_device_properties)
        return read

    return install
