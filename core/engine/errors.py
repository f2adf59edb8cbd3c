"""Error types every layer may raise or catch; this module imports nothing of the engine."""

from __future__ import annotations


class SelectionError(RuntimeError):
    """No component fits, or the choice is ambiguous."""


class WorkerDiedError(RuntimeError):
    """A tensor-parallel rank went away: the engine cannot go on."""
