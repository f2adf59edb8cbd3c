"""Kernel tests run once per instruction-set variant this CPU can execute (an AVX2 build runs
on an AVX-512 machine too), so every variant's code paths are tested wherever the suite runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))

from cpu_isa import ISA_VARIANTS, use_isa  # noqa: E402

from engine_cpu import native  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def kernels_whatever_the_environment_says():
    """These are the kernels' own tests: they build and run the kernels even under
    ENGINE_CPU_NATIVE=0, which decides what the engine runs (the rest of the suite then covers
    the torch paths). Module-scoped, so it holds before each_isa forces a build."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.delenv("ENGINE_CPU_NATIVE", raising=False)
        yield


@pytest.fixture(scope="module", params=ISA_VARIANTS)
def each_isa(request):
    """The tests of a module once per variant (module-scoped, so each build is forced once per module)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        use_isa(monkeypatch, request.param)
        yield request.param


@pytest.fixture
def gemv_kernels(each_isa):
    kernels = native.load()
    if not kernels.gemv_supported():
        pytest.skip(f"the {each_isa} build has no gemv (AVX512-BF16 only)")
    return kernels


@pytest.fixture
def amx_kernels(each_isa):
    kernels = native.load()
    if not kernels.amx_supported():
        pytest.skip(f"the {each_isa} build has no amx_linear (AMX builds on CPUs and kernels that allow the tiles)")
    return kernels
