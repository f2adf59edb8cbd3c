"""Throwaway plugins for tests: a module plus a fake installed distribution.

A :class:`PluginFactory` writes modules and ``<dist>-<version>.dist-info``
folders (``METADATA`` and ``entry_points.txt``) into one directory that is
prepended to ``sys.path``, so ``importlib.metadata.entry_points(group=
"engine.plugins")`` discovers them next to the really installed plugins. Every
module name carries a per-factory suffix, so tests never share modules; the
factory forgets its modules again in :meth:`PluginFactory.cleanup`.

Import it from a test module with::

    sys.path.insert(0, str(Path(__file__).parent))
    from plugin_helpers import PluginFactory
"""

from __future__ import annotations

import importlib
import os
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

ENGINE_ENV_VARS = ("ENGINE_PLUGINS", "ENGINE_TRACE_PLUGINS")
REAL_PLUGINS = {"cpu": "engine-cpu", "llama": "engine-llama"}


class PluginFactory:
    """Writes throwaway plugin modules and distributions under ``root``."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self.suffix = uuid.uuid4().hex[:8]
        self._modules: list[str] = []
        monkeypatch.syspath_prepend(str(self.root))

    def name(self, base: str) -> str:
        """A module or entry-point name unique to this factory."""
        return f"{base}_{self.suffix}"

    def module(self, name: str, source: str) -> str:
        """Write module ``name`` (dotted names become packages) and return its name."""
        parts = name.split(".")
        folder = self.root
        for index, part in enumerate(parts[:-1]):
            folder = folder / part
            folder.mkdir(exist_ok=True)
            init = folder / "__init__.py"
            if not init.exists():
                init.write_text("")
            self._forget(".".join(parts[: index + 1]))
        (folder / f"{parts[-1]}.py").write_text(textwrap.dedent(source))
        self._forget(name)
        importlib.invalidate_caches()
        return name

    def distribution(
        self, dist: str, entry_points: dict[str, str], version: str = "1.0", requires: tuple[str, ...] = ()
    ) -> None:
        """Write ``<dist>-<version>.dist-info`` with these ``engine.plugins`` entry points
        (and ``Requires-Dist`` lines)."""
        info = self.root / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        requires_lines = "".join(f"Requires-Dist: {r}\n" for r in requires)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n{requires_lines}")
        lines = ["[engine.plugins]"] + [f"{ep} = {target}" for ep, target in entry_points.items()]
        (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
        importlib.invalidate_caches()

    def plugin(
        self, base: str, source: str, *, dist: str | None = None, version: str = "1.0", requires: tuple[str, ...] = ()
    ) -> str:
        """An installed plugin: module ``<base>_<suffix>`` under entry point of the same name.

        Returns the entry-point name (which is also the module name).
        """
        name = self.name(base)
        self.module(name, source)
        self.distribution(dist or f"dist-{name.replace('_', '-')}", {name: name}, version, requires)
        return name

    def env(self) -> dict[str, str]:
        """Environment for a subprocess that sees these plugins and no engine settings."""
        env = {k: v for k, v in os.environ.items() if k not in ENGINE_ENV_VARS}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(self.root), env.get("PYTHONPATH")]))
        env["HF_HUB_OFFLINE"] = "1"
        return env

    def _forget(self, name: str) -> None:
        if name not in self._modules:
            self._modules.append(name)
        sys.modules.pop(name, None)

    def cleanup(self) -> None:
        for name in self._modules:
            sys.modules.pop(name, None)
        importlib.invalidate_caches()


def hooks_source(**hooks: str) -> str:
    """Source of a hook module: ``hooks_source(register_kv_tiers='register("a", "m:C")')``."""
    parts = ["import engine\n"]
    for hook, body in hooks.items():
        body = textwrap.indent(textwrap.dedent(body).strip(), "    ")
        parts.append(f"\n@engine.hookimpl\ndef {hook}(register):\n{body}\n")
    return "".join(parts)


def run_kit_in_subprocess(pytester, **files: str) -> dict[tuple[str, str], str]:
    """Write ``files`` (module name -> source) and run pytest on them in a fresh process (torch
    cannot be imported twice in one); returns {(test class, check): outcome} of every check
    that passed, failed, errored or was skipped with its node id."""
    pytester.makepyfile(**{name: textwrap.dedent(source) for name, source in files.items()})
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q", "-rA", "-p", "no:randomly")
    outcomes = {}
    for line in result.outlines:
        status, _, nodeid = line.partition(" ")
        if status in ("PASSED", "FAILED", "SKIPPED", "ERROR") and "::" in nodeid:
            _, cls, check = nodeid.split(" ")[0].split("::")
            outcomes[(cls, check)] = status.lower()
    return outcomes


def kit_subclasses(kit_class: str, plugin: str, name_attribute: str, names: list[str]) -> str:
    """Source of a test module with one ``Test_<name>`` subclass of the kit class per name."""
    return f"from engine.testing.kit import {kit_class}\n" + "".join(
        f"\nclass Test_{name}({kit_class}):\n    plugin = {plugin!r}\n    {name_attribute} = {name!r}\n"
        for name in names
    )


def assert_broken_caught_and_good_passes(
    outcomes: dict[tuple[str, str], str], caught_by: dict[str, tuple[str, ...]], good_checks: int
) -> None:
    """Every check named for a broken variant failed on it, and variant ``good`` passed its
    ``good_checks`` checks (and nothing else)."""
    for name, checks in caught_by.items():
        for check in checks:
            assert outcomes.get((f"Test_{name}", check)) == "failed", f"{name}: {check} did not fail"
    good = {check: outcome for (cls, check), outcome in outcomes.items() if cls == "Test_good"}
    assert len(good) == good_checks and set(good.values()) == {"passed"}, good
