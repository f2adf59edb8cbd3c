"""Attention backend preferences: AITER's first when ``aiter`` imports, then the built-in Triton backends."""

from __future__ import annotations

import logging
import sys
import types

import pytest

from engine.interfaces.attention import INDEXER, LINEAR, MAMBA2, MHA, MLA, SLIDING_WINDOW, SPARSE_MLA
from engine.plugins.manager import get_plugin_manager
from engine_rocm.platform import RocmPlatform

TRITON = {
    MHA: ("triton_paged",),
    SLIDING_WINDOW: ("triton_paged",),
    MLA: ("triton_mla",),
    LINEAR: ("triton_kda",),
    MAMBA2: ("triton_mamba2",),
    SPARSE_MLA: (),
    INDEXER: (),
}
WITH_AITER = {
    MHA: ("aiter_mha", "triton_paged"),
    SLIDING_WINDOW: ("aiter_mha", "triton_paged"),
    MLA: ("triton_mla",),
    LINEAR: ("triton_kda",),
    MAMBA2: ("triton_mamba2",),
    SPARSE_MLA: (),
    INDEXER: (),
}


def usable_aiter() -> types.ModuleType:
    """An aiter with what aiter_mha calls."""
    module = types.ModuleType("aiter")
    module.flash_attn_varlen_func = lambda *args, **kwargs: None
    return module


def preferences() -> dict[str, tuple[str, ...]]:
    platform = RocmPlatform()
    return {kind: platform.attention_backend_preferences(kind) for kind in TRITON}


def test_without_aiter_the_triton_backends(monkeypatch):
    monkeypatch.setitem(sys.modules, "aiter", None)  # import aiter raises ModuleNotFoundError
    assert preferences() == TRITON


def test_with_aiter_its_backends_come_first(monkeypatch):
    monkeypatch.setitem(sys.modules, "aiter", usable_aiter())
    assert preferences() == WITH_AITER


def test_aiter_can_be_switched_off(monkeypatch):
    monkeypatch.setitem(sys.modules, "aiter", usable_aiter())
    monkeypatch.setenv("ENGINE_ROCM_AITER", "0")
    assert preferences() == TRITON


@pytest.mark.parametrize(
    "body, cause",
    [
        ("raise OSError('libamdhip64.so: cannot open shared object file')", "OSError: libamdhip64.so"),
        ("import aiter_jit_dependency_that_is_missing", "No module named 'aiter_jit_dependency_that_is_missing'"),
    ],
)
def test_an_aiter_that_fails_to_import_is_skipped_with_a_warning(monkeypatch, tmp_path, caplog, body, cause):
    package = tmp_path / "aiter"
    package.mkdir()
    (package / "__init__.py").write_text(body + "\n")
    monkeypatch.delitem(sys.modules, "aiter", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="engine"):
        assert preferences() == TRITON
    assert "aiter is installed but cannot be imported" in caplog.text
    assert cause in caplog.text


def test_an_aiter_without_varlen_flash_attention_is_passed_over(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "aiter", types.ModuleType("aiter"))
    with caplog.at_level(logging.WARNING, logger="engine"):
        assert preferences() == TRITON
    assert "has no flash_attn_varlen_func; using the Triton backends" in caplog.text


def test_aiter_is_probed_once_per_platform(monkeypatch):
    imports = []

    class CountingFinder:
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name == "aiter":
                imports.append(name)

    monkeypatch.delitem(sys.modules, "aiter", raising=False)
    monkeypatch.setattr(sys, "meta_path", [CountingFinder(), *sys.meta_path])
    platform = RocmPlatform()
    for kind in TRITON:
        platform.attention_backend_preferences(kind)
    assert imports == ["aiter"]


def test_triton_preferences_are_registered_by_the_engine_for_rocm(monkeypatch):
    monkeypatch.setitem(sys.modules, "aiter", None)
    backends = get_plugin_manager(["rocm"]).components().attention_backends
    for kind, names in preferences().items():
        for name in names:
            capabilities = backends.get(name).capabilities
            assert kind in capabilities.kinds and "rocm" in capabilities.platforms, name
