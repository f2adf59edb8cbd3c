"""What every kit class shares: the plugin under test, discovery through the plugin
manager, capability skips, and expected failures."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

CAPABILITY_PREFIX = "capability not declared: "


def capability_skip(capability: str) -> None:
    """Skip the running check because the component does not declare ``capability``."""
    pytest.skip(CAPABILITY_PREFIX + capability)


class KitTests:
    """Base of the kit classes (not collected by itself: its name does not start with Test).

    ``plugin``: the entry-point name (or dotted module path) that provides the
    component; the kit loads exactly that plugin and ``also_load``, as
    ``--plugins NAME,...`` would.
    ``expected_failures``: ``{"test_name": "reason"}``, run as strict xfails, so
    a fixed failure is reported too.
    """

    plugin: ClassVar[str | None] = None
    also_load: ClassVar[tuple[str, ...]] = ()  # plugins the component needs beside its own (a platform, backends)
    expected_failures: ClassVar[dict[str, str]] = {}
    # the Components registry attribute the component lives in ("platforms", "attention_backends", ...)
    registry_name: ClassVar[str] = ""

    def required(self, name: str) -> Any:
        """A class attribute the subclass must set."""
        value = getattr(type(self), name, None)
        if value is None:
            raise NotImplementedError(f"{type(self).__name__} must set the class attribute {name!r}.")
        return value

    def components(self) -> Any:
        from engine.plugins.manager import get_plugin_manager

        return get_plugin_manager([self.required("plugin"), *self.also_load]).components()

    def assert_named(self, cls: Any, name: str) -> None:
        """``cls`` is what ``name`` names: the class a ``module.path:Class`` reference resolves
        to, or a class whose ``name`` attribute is the registered name."""
        from engine.plugins.qualname import is_qualname, resolve_qualname

        if is_qualname(name):
            assert cls is resolve_qualname(name), f"{name!r} resolves to {cls!r}"
        else:
            found = getattr(cls, "name", None)
            assert found == name, f"registered as {name!r}, but its class's name attribute is {found!r}"

    def resolve(self, name: str) -> Any:
        """The registered component ``name`` of this kit's kind, as the engine would load it."""
        return self.components().registry(self.registry_name).get(name)
