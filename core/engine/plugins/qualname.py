"""Resolution of ``module.path:ClassName`` references, the one qualname format."""

from __future__ import annotations

import importlib
from typing import Any


def is_qualname(value: str) -> bool:
    """True for ``module.path:Attr`` (a colon with text on both sides)."""
    module, sep, attr = value.partition(":")
    return bool(sep and module and attr and ":" not in attr)


def resolve_qualname(value: str, *, what: str = "component") -> Any:
    """Import ``module.path:Attr`` (``Attr`` may be dotted) and return the object.

    Raises ``ImportError`` with the reference, what it was for and the cause.
    """
    if not is_qualname(value):
        raise ValueError(f"Expected 'module.path:ClassName' for the {what}, got {value!r}.")
    module_name, _, attr_path = value.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(
            f"Cannot import module {module_name!r} for the {what} {value!r}: {type(exc).__name__}: {exc}"
        ) from exc
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise ImportError(f"Module {module_name!r} has no attribute {attr_path!r} (the {what} {value!r}).") from exc
    return obj
