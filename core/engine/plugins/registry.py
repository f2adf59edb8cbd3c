"""A registry of named components for one extension kind.

Entries are classes or lazy ``"module.path:Class"`` strings; a string is
imported the first time the component is looked up. Any name that is itself a
``module.path:Class`` reference resolves directly, without registration.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from engine.plugins.qualname import is_qualname, resolve_qualname

T = TypeVar("T")


class RegisterCallback(Protocol):
    """The ``register`` callback passed to every registration hook."""

    def __call__(self, name_or_component: Any, component: Any = None, *, override: bool = False) -> None: ...


class ComponentError(LookupError):
    """An unknown, duplicate or unusable component name."""


class DuplicateComponentError(ComponentError):
    """A name registered a second time without ``override=True``; ``previous`` holds it."""

    def __init__(self, message: str, previous: RegistryEntry) -> None:
        super().__init__(message)
        self.previous = previous


BUILT_IN = "engine"  # the plugin name of components the engine itself provides


@dataclass(frozen=True)
class RegistryEntry:
    name: str
    target: Any  # a class, or a "module.path:Class" string resolved on first use
    plugin: str
    distribution: str

    @property
    def target_repr(self) -> str:
        if isinstance(self.target, str):
            return self.target
        return f"{self.target.__module__}:{self.target.__qualname__}"


class Registry(Generic[T]):
    """Named components of one kind (``kind`` is the human label, e.g. "KV tier").

    ``interface`` is the ``module:Class`` of the ABC every component must
    subclass; it is checked when the component is resolved, so registering
    imports nothing.
    """

    def __init__(self, kind: str, interface: str, option: str | None = None) -> None:
        self.kind = kind
        self.interface = interface
        self.option = option
        self._entries: dict[str, RegistryEntry] = {}
        self._resolved: dict[str, type[T]] = {}
        self._withdrawn: dict[str, str] = {}  # name -> why no component holds it (a conflict)

    def add(
        self, name: str, target: Any, *, plugin: str, distribution: str, override: bool = False
    ) -> RegistryEntry | None:
        """Register ``target`` under ``name``; returns the entry it replaced (``override=True``),
        or None. A name taken by another plugin or built into the engine is a
        :class:`DuplicateComponentError` unless ``override`` is set."""
        if not isinstance(name, str) or not name:
            raise ComponentError(f"A {self.kind} must be registered under a non-empty string name, got {name!r}.")
        if not (isinstance(target, type) or (isinstance(target, str) and is_qualname(target))):
            raise ComponentError(
                f"{self.kind.capitalize()} {name!r} from plugin {plugin!r} must be a class or a "
                f"'module.path:ClassName' string, got {target!r}."
            )
        previous = self._entries.get(name)
        if previous is not None and not override:
            if previous.plugin == BUILT_IN:
                raise DuplicateComponentError(
                    f"Plugin {plugin!r} (distribution {distribution}) registers the {self.kind} {name!r}, "
                    f"which is built into the engine ({previous.target_repr}). Register it with "
                    f"override=True to replace the built-in one, or choose another name.",
                    previous,
                )
            raise DuplicateComponentError(
                f"Duplicate {self.kind} {name!r}: registered by plugin {previous.plugin!r} "
                f"(distribution {previous.distribution}) and by plugin {plugin!r} "
                f"(distribution {distribution}). Uninstall one, or have the later plugin "
                f"register it with override=True.",
                previous,
            )
        self._entries[name] = RegistryEntry(name, target, plugin, distribution)
        self._resolved.pop(name, None)
        self._withdrawn.pop(name, None)
        return previous

    def withdraw(self, name: str, reason: str) -> None:
        """Take ``name`` out of the registry; looking it up then raises ``reason``."""
        self._entries.pop(name, None)
        self._resolved.pop(name, None)
        self._withdrawn[name] = reason

    def withdrawn(self, name: str) -> str | None:
        """Why ``name`` was taken out (:meth:`withdraw`), or None."""
        return self._withdrawn.get(name)

    def snapshot(self) -> tuple[dict[str, RegistryEntry], dict[str, str]]:
        return dict(self._entries), dict(self._withdrawn)

    def restore(self, snapshot: tuple[dict[str, RegistryEntry], dict[str, str]]) -> None:
        """Undo every change since :meth:`snapshot` returned ``snapshot``."""
        self._entries, self._withdrawn = dict(snapshot[0]), dict(snapshot[1])
        self._resolved.clear()

    def names(self) -> list[str]:
        return sorted(self._entries)

    def entries(self) -> list[RegistryEntry]:
        return [self._entries[name] for name in self.names()]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def entry(self, name: str) -> RegistryEntry:
        try:
            return self._entries[name]
        except KeyError:
            raise ComponentError(self.unknown_message(name)) from None

    def unknown_message(self, name: str) -> str:
        if name in self._withdrawn:
            return self._withdrawn[name]
        available = ", ".join(self.names()) or "none"
        return (
            f"Unknown {self.kind} {name!r}. Available: {available}. "
            f"Install a plugin that provides it or pass module.path:ClassName."
        )

    def get(self, name: str) -> type[T]:
        """Return the component class for ``name`` or a ``module.path:Class`` reference.

        Raises :class:`ComponentError` for unknown names, and ``ImportError`` /
        ``TypeError`` when the target cannot be imported or is not a subclass of
        the interface.
        """
        if name in self._resolved:
            return self._resolved[name]
        if name in self._entries:
            entry = self._entries[name]
            target = entry.target
            origin = f"{self.kind} {name!r} (plugin {entry.plugin!r}, distribution {entry.distribution})"
        elif is_qualname(name):
            target = name
            origin = f"{self.kind} {name!r}"
        else:
            raise ComponentError(self.unknown_message(name))
        cls = resolve_qualname(target, what=self.kind) if isinstance(target, str) else target
        interface = resolve_qualname(self.interface, what="interface")
        if not (isinstance(cls, type) and issubclass(cls, interface)):
            raise TypeError(
                f"The {origin} resolves to {cls!r}, which is not a subclass of "
                f"{interface.__module__}.{interface.__qualname__}."
            )
        self._resolved[name] = cls
        return cls
