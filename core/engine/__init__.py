"""engine: an LLM inference and serving engine with a thin core and plugins.

Importing this package is cheap: it loads no torch and no plugins. The heavy
entry points (`LLM`, `SamplingParams`, ...) are imported on first attribute access.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import pluggy

from engine.version import PLUGIN_API_VERSION, __version__

hookimpl = pluggy.HookimplMarker("engine")
"""Marker for plugin hook implementations: ``@engine.hookimpl``."""

_LAZY = {
    "LLM": "engine.llm:LLM",
    "SamplingParams": "engine.sampling_params:SamplingParams",
    "RequestOutput": "engine.outputs:RequestOutput",
    "CompletionOutput": "engine.outputs:CompletionOutput",
    "get_plugin_manager": "engine.plugins.manager:get_plugin_manager",
}

if TYPE_CHECKING:
    from engine.llm import LLM
    from engine.outputs import CompletionOutput, RequestOutput
    from engine.plugins.manager import get_plugin_manager
    from engine.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    module_name, attr = target.split(":")
    return getattr(importlib.import_module(module_name), attr)


__all__ = [
    "hookimpl",
    "__version__",
    "PLUGIN_API_VERSION",
    "LLM",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "get_plugin_manager",
]
