"""Time spent inside chosen modules during engine steps, measured with torch's public
forward hooks (``register_forward_pre_hook`` / ``register_forward_hook``).

The engine's own step timings (``StepResult.timings``) give every phase of a step;
this covers what lies inside one of them, such as the attention layers inside the
forward. The hooks exist only inside the ``with`` block; leaving it removes them.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch


class ModuleTimer:
    """Accumulates the seconds spent in the forward of ``modules`` since the last :meth:`take`.

    ``synchronize`` is called before each clock reading so that asynchronous devices are
    timed correctly; on the CPU it is a no-op. A module's forward that raises is not
    counted (torch calls no forward hook then)."""

    def __init__(self, modules: Sequence[torch.nn.Module], synchronize: Callable[[], None] = lambda: None) -> None:
        if not modules:
            raise ValueError("ModuleTimer needs at least one module to time.")
        self.modules = list(modules)
        self._synchronize = synchronize
        self._handles: list[Any] = []
        self._starts: dict[int, float] = {}  # id(module) -> clock at its forward's start
        self.seconds = 0.0

    def take(self) -> float:
        """Seconds since the last call; resets them."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def __enter__(self) -> ModuleTimer:
        self.seconds = 0.0
        for module in self.modules:
            self._handles.append(module.register_forward_pre_hook(self._started))
            self._handles.append(module.register_forward_hook(self._ended))
        return self

    def __exit__(self, *exc: object) -> None:
        while self._handles:
            self._handles.pop().remove()
        self._starts.clear()

    def _started(self, module: torch.nn.Module, args: Any) -> None:
        self._synchronize()
        self._starts[id(module)] = time.perf_counter()

    def _ended(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._synchronize()
        self.seconds += time.perf_counter() - self._starts.pop(id(module))
