"""The errors and warnings of plugin loading.

A leaf module: it imports nothing from the engine, so the manager, the component
registries and the CLI can all raise and catch these without importing each other.
``engine.plugins.manager`` re-exports them.
"""

from __future__ import annotations


class PluginLoadError(RuntimeError):
    """A plugin that was asked for could not be loaded or is malformed."""


class PluginVersionWarning(UserWarning):
    """A plugin was built for a range of engine versions that excludes this one."""


class PluginLoadWarning(UserWarning):
    """An autoloaded plugin failed; the others were loaded."""


def clause(text: str) -> str:
    """``text`` without its closing full stop, to continue it in a longer sentence."""
    return text.rstrip().rstrip(".")
