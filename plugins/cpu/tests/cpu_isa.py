"""Forcing one instruction-set build of the engine-cpu kernels in a test."""

from __future__ import annotations

import pytest

from engine_cpu import native

ISA_VARIANTS = [v.name for v in native.runnable_variants()]


def use_isa(monkeypatch: pytest.MonkeyPatch, name: str):
    """Force the ``name`` build for the rest of the test; it must build."""
    monkeypatch.setenv("ENGINE_CPU_ISA", name)
    kernels = native.load()
    if kernels is None:
        pytest.fail(f"the engine-cpu {name} kernels failed to build (see the engine.cpu log)")
    assert kernels.variant == name
    return kernels
