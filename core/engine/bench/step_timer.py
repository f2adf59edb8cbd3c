"""Time spent inside chosen methods during an engine step, measured from outside.

Each method is shadowed by an instance attribute that times the original bound
method (the class and the engine's code stay untouched); leaving the ``with``
block removes the attributes again. ``nn.Module.__call__`` looks ``forward`` up
on the instance, so a model's forward is timed however the runner calls it.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any, Callable

_MISSING = object()


class CallTimer:
    """Accumulates seconds per label over the wrapped calls since the last :meth:`take`.

    ``add(obj, "forward", "model", count_tokens=True)`` also records
    ``len(first argument)`` of every call (the number of tokens of a forward).
    ``synchronize`` is called around each timed call so that asynchronous devices
    are timed correctly; on the CPU it is a no-op.
    """

    def __init__(self, synchronize: Callable[[], None] = lambda: None) -> None:
        self._synchronize = synchronize
        self._targets: list[tuple[Any, str, str, bool]] = []
        self._saved: list[tuple[Any, str, Any]] = []
        self.seconds: dict[str, float] = defaultdict(float)
        self.tokens: dict[str, list[int]] = defaultdict(list)

    def add(self, obj: Any, attr: str, label: str, *, count_tokens: bool = False) -> None:
        if not callable(getattr(obj, attr, None)):
            raise AttributeError(f"{type(obj).__name__} has no method {attr!r} to time.")
        self._targets.append((obj, attr, label, count_tokens))

    def labels(self) -> list[str]:
        return list(dict.fromkeys(label for _, _, label, _ in self._targets))

    def take(self) -> tuple[dict[str, float], dict[str, list[int]]]:
        """Seconds and token counts per label since the last call; resets both."""
        seconds, tokens = dict(self.seconds), {k: list(v) for k, v in self.tokens.items()}
        self.seconds.clear()
        self.tokens.clear()
        return seconds, tokens

    def __enter__(self) -> CallTimer:
        for obj, attr, label, count_tokens in self._targets:
            self._saved.append((obj, attr, vars(obj).get(attr, _MISSING)))
            setattr(obj, attr, self._timed(getattr(obj, attr), label, count_tokens))
        return self

    def __exit__(self, *exc: object) -> None:
        while self._saved:
            obj, attr, previous = self._saved.pop()
            if previous is _MISSING:
                delattr(obj, attr)
            else:
                setattr(obj, attr, previous)

    def _timed(self, method: Callable[..., Any], label: str, count_tokens: bool) -> Callable[..., Any]:
        seconds, tokens, synchronize = self.seconds, self.tokens, self._synchronize
        clock = time.perf_counter

        def timed(*args: Any, **kwargs: Any) -> Any:
            synchronize()
            start = clock()
            result = method(*args, **kwargs)
            synchronize()
            seconds[label] += clock() - start
            if count_tokens and args:
                tokens[label].append(len(args[0]))
            return result

        return timed
