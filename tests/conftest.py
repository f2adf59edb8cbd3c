from __future__ import annotations

import sys
from pathlib import Path

import pytest

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))
from plugin_helpers import ENGINE_ENV_VARS, PluginFactory  # noqa: E402


@pytest.fixture(autouse=True)
def _no_engine_env(monkeypatch):
    """Tests choose their plugins explicitly: the caller's ENGINE_* variables never leak in."""
    for var in ENGINE_ENV_VARS:
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def factory(tmp_path, monkeypatch):
    """Writes throwaway plugins and fake installed distributions (see plugin_helpers)."""
    plugins = PluginFactory(tmp_path / "site", monkeypatch)
    yield plugins
    plugins.cleanup()
