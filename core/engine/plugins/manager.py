"""Discovery and loading of plugins: ``get_plugin_manager`` is the only way in.

Nothing is loaded at import time. Plugins come from the ``engine.plugins``
entry-point group or from dotted module paths named in the selection.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata as md
import importlib.util
import logging
import os
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import pluggy

from engine import hookspecs
from engine.plugins.components import Components
from engine.plugins.errors import PluginLoadError, PluginLoadWarning, PluginVersionWarning, clause
from engine.plugins.tracing import enable_tracing

logger = logging.getLogger("engine.plugins")

ENTRY_POINT_GROUP = "engine.plugins"
PLUGINS_ENV = "ENGINE_PLUGINS"
TRACE_ENV = "ENGINE_TRACE_PLUGINS"


__all__ = [
    "ENTRY_POINT_GROUP",
    "EnginePluginManager",
    "PluginInfo",
    "PluginLoadError",
    "PluginLoadWarning",
    "PluginVersionWarning",
    "get_plugin_manager",
    "parse_plugin_selection",
]


@dataclass
class PluginInfo:
    """One discovered plugin and what became of it."""

    name: str
    source: str  # "entry_point" or "module"
    module: str
    distribution: str | None = None
    version: str | None = None
    requested: bool = False
    loaded: bool = False
    error: str | None = None
    hooks: list[str] = field(default_factory=list)
    components: dict[str, list[str]] = field(default_factory=dict)
    # kind -> the components it replaced with override=True: {"name", "plugin" and "target" it replaced}
    replaced: dict[str, list[dict[str, str]]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # what of it was skipped (a failing hook, a duplicate)

    @property
    def distribution_label(self) -> str:
        if self.distribution:
            return f"{self.distribution} {self.version}" if self.version else self.distribution
        return f"module {self.module}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "source": self.source,
            "module": self.module,
            "distribution": self.distribution,
            "version": self.version,
            "requested": self.requested,
            "loaded": self.loaded,
            "error": self.error,
            "hooks": list(self.hooks),
            "components": {k: list(v) for k, v in self.components.items()},
            "replaced": {k: [dict(r) for r in v] for k, v in self.replaced.items()},
            "problems": list(self.problems),
        }

    @property
    def state(self) -> str:
        """ "loaded", "loaded with problems" (something of it was skipped) or "FAILED"."""
        if not self.loaded:
            return "FAILED"
        return "loaded with problems" if self.problems else "loaded"


class EnginePluginManager(pluggy.PluginManager):
    """A pluggy manager that also records what was discovered and why it failed.

    ``trace=True`` installs the call monitor of :func:`engine.plugins.tracing.enable_tracing`.
    """

    def __init__(self, trace: bool = False) -> None:
        super().__init__("engine")
        self.add_hookspecs(hookspecs)
        self.plugin_infos: list[PluginInfo] = []
        self.trace_enabled = trace
        self._components: Components | None = None
        if trace:
            enable_tracing(self)

    def info_for(self, name: str) -> PluginInfo | None:
        for info in self.plugin_infos:
            if info.name == name:
                return info
        return None

    def distribution_label(self, name: str) -> str:
        info = self.info_for(name)
        return info.distribution_label if info is not None else "?"

    @property
    def load_errors(self) -> list[PluginInfo]:
        return [info for info in self.plugin_infos if info.error]

    def autoloaded(self, name: str) -> bool:
        """Whether plugin ``name`` was loaded without being asked for (its failures are warnings)."""
        info = self.info_for(name)
        return info is not None and not info.requested

    def components(self) -> Components:
        """Call every registration hook once and return the filled registries."""
        if self._components is None:
            components = Components.from_plugin_manager(self, self.distribution_label, self.autoloaded)
            for info in self.plugin_infos:
                info.components = components.added_by.get(info.name, {})
                info.problems.extend(components.problems.get(info.name, []))
                for replacement in components.replacements:
                    if replacement.plugin == info.name:
                        info.replaced.setdefault(replacement.kind, []).append(
                            {
                                "name": replacement.name,
                                "plugin": replacement.previous.plugin,
                                "target": replacement.previous.target_repr,
                            }
                        )
            self._components = components
        return self._components


def parse_plugin_selection(value: str | Iterable[str] | None) -> list[str] | None:
    """``None`` means autoload; a string is a comma-separated list ("" selects none)."""
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else list(value)
    return [item.strip() for item in items if item and item.strip()]


def get_plugin_manager(
    plugins: str | Iterable[str] | None = None,
    autoload: bool | None = None,
    *,
    trace: bool | None = None,
) -> EnginePluginManager:
    """Discover and load plugins.

    :param plugins: names to load, as a list or a comma-separated string. Each
        is an entry-point name in the ``engine.plugins`` group or a dotted module
        path holding hookimpls. ``None`` reads ``ENGINE_PLUGINS``; when that is
        unset too, every installed plugin is autoloaded. An empty selection
        loads none.
    :param autoload: also load every other discovered entry point, leniently.
        Defaults to True only when no selection was given.
    :param trace: log every hook call; defaults to ``ENGINE_TRACE_PLUGINS=1``.
    :raises PluginLoadError: when a selected plugin is unknown, fails to import
        or implements a hook that does not exist.
    """
    if plugins is None:
        plugins = os.environ.get(PLUGINS_ENV)
    selection = parse_plugin_selection(plugins)
    if autoload is None:
        autoload = selection is None
    if trace is None:
        trace = os.environ.get(TRACE_ENV, "") not in ("", "0", "false", "False")

    pm = EnginePluginManager(trace=trace)
    entry_points = _discover()

    for name in selection or []:
        _load_requested(pm, name, entry_points)
    if autoload:
        for name, group in _by_name(entry_points).items():
            if pm.info_for(name) is not None:
                continue  # asked for by name, or a module path of the same name
            if len(group) == 1:
                _load_entry_point(pm, group[0], requested=False)
            else:
                _skip_duplicate_entry_points(pm, name, group)
    return pm


def _by_name(entry_points: list[md.EntryPoint]) -> dict[str, list[md.EntryPoint]]:
    """Entry points by name, one per distribution (a distribution seen twice on the path counts once)."""
    groups: dict[str, list[md.EntryPoint]] = {}
    for ep in entry_points:
        group = groups.setdefault(ep.name, [])
        if all(_dist_name(other) != _dist_name(ep) for other in group):
            group.append(ep)
    return groups


def _skip_duplicate_entry_points(pm: EnginePluginManager, name: str, group: list[md.EntryPoint]) -> None:
    """Two distributions provide plugin ``name``: neither is loaded, and both are listed."""
    dists = " and ".join(_dist_name(ep) or "?" for ep in group)
    message = (
        f"Plugin {name!r} is provided by more than one distribution: {dists}; neither was loaded. "
        f"Uninstall one of them."
    )
    for ep in group:
        pm.plugin_infos.append(_entry_point_info(ep, requested=False, error=message))
    warnings.warn(message, PluginLoadWarning, stacklevel=3)
    logger.warning(message)


def _discover() -> list[md.EntryPoint]:
    return sorted(md.entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name)


def _installed_names(entry_points: list[md.EntryPoint]) -> str:
    return ", ".join(sorted({ep.name for ep in entry_points})) or "none"


def _load_requested(pm: EnginePluginManager, name: str, entry_points: list[md.EntryPoint]) -> None:
    if pm.info_for(name) is not None:
        return
    matches = [ep for ep in entry_points if ep.name == name]
    if len(matches) > 1:
        dists = " and ".join(_dist_name(ep) or "?" for ep in matches)
        raise PluginLoadError(
            f"Plugin {name!r} is provided by more than one distribution: {dists}. Uninstall one of them."
        )
    if matches:
        _load_entry_point(pm, matches[0], requested=True)
        return
    if "." in name or _module_exists(name):
        _load_module(pm, name)
        return
    raise PluginLoadError(
        f"Unknown plugin {name!r}. Installed plugins: {_installed_names(entry_points)}. "
        f"Install the distribution that provides it, or name an importable module path "
        f"(e.g. my_pkg.my_plugin)."
    )


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _dist_name(ep: md.EntryPoint) -> str | None:
    dist = getattr(ep, "dist", None)
    return dist.metadata["Name"] if dist is not None else None


def _entry_point_info(ep: md.EntryPoint, *, requested: bool, error: str | None = None) -> PluginInfo:
    dist = getattr(ep, "dist", None)
    return PluginInfo(
        name=ep.name,
        source="entry_point",
        module=ep.value,
        distribution=_dist_name(ep),
        version=dist.version if dist is not None else None,
        requested=requested,
        error=error,
    )


def _load_entry_point(pm: EnginePluginManager, ep: md.EntryPoint, *, requested: bool) -> None:
    dist = getattr(ep, "dist", None)
    info = _entry_point_info(ep, requested=requested)
    pm.plugin_infos.append(info)
    if dist is not None:
        _check_engine_range(info, dist)
    try:
        plugin = ep.load()
    except Exception as exc:  # any import-time failure of third-party code
        _fail(pm, info, _entry_point_failure(ep, info.distribution, exc), exc)
        return
    _register(pm, info, plugin)


def _entry_point_failure(ep: md.EntryPoint, distribution: str | None, exc: BaseException) -> str:
    """Why ``ep.load()`` raised ``exc``: a module or attribute the entry point names that does
    not exist, or an error inside the plugin's code, with the file and line that raised it."""
    named_by = f"entry point {ep.name!r} of distribution {distribution!r}"
    if isinstance(exc, ModuleNotFoundError) and exc.name and _is_same_or_parent(exc.name, ep.module):
        return (
            f"{named_by} names module {ep.module!r}, which does not exist (no module {exc.name!r}). "
            f"Reinstall the distribution, or fix the module path in its entry points"
        )
    if isinstance(exc, AttributeError) and ep.attr and _module_exists(ep.module):
        module = importlib.import_module(ep.module)
        if not hasattr(module, ep.attr.split(".")[0]):
            return f"{named_by} names {ep.value!r}, but module {ep.module!r} has no attribute {ep.attr!r}"
    return f"import of {ep.value!r} failed: {_described(exc)}"


def _is_same_or_parent(name: str, module: str) -> bool:
    return module == name or module.startswith(name + ".")


def _described(exc: BaseException) -> str:
    """``Type: message (raised at file:line)`` and where to find the traceback."""
    where = _raised_at(exc)
    at = f" (raised at {where})" if where else ""
    return f"{type(exc).__name__}: {clause(str(exc))}{at}. Set {TRACE_ENV}=1 to see the traceback"


def _raised_at(exc: BaseException) -> str | None:
    """``file:line`` of the frame that raised ``exc``, past the import machinery's own frames
    (a syntax error: the line it points at)."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{exc.filename}:{exc.lineno}"
    machinery = str(Path(importlib.__file__).parent)
    where = None
    for frame, line in traceback.walk_tb(exc.__traceback__):
        filename = frame.f_code.co_filename
        if filename.startswith("<frozen ") or filename.startswith(machinery) or filename == __file__:
            continue
        where = f"{filename}:{line}"
    return where


def _check_engine_range(info: PluginInfo, dist: md.Distribution) -> None:
    """Warn when the plugin's distribution declares an ``engine`` range that excludes this engine."""
    from packaging.requirements import InvalidRequirement, Requirement

    from engine.version import __version__

    for line in dist.requires or []:
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            continue
        if requirement.name.lower() != "engine" or requirement.marker is not None and not requirement.marker.evaluate():
            continue
        if requirement.specifier and not requirement.specifier.contains(__version__, prereleases=True):
            message = (
                f"Plugin {info.name!r} ({info.distribution_label}) supports engine{requirement.specifier}, but this is engine "
                f"{__version__}: it may fail or misbehave. Install a version of {info.distribution} made for "
                f"engine {__version__}, or an engine in its range."
            )
            warnings.warn(message, PluginVersionWarning, stacklevel=4)
            logger.warning(message)
        return


def _load_module(pm: EnginePluginManager, module_path: str) -> None:
    info = PluginInfo(name=module_path, source="module", module=module_path, requested=True)
    pm.plugin_infos.append(info)
    try:
        plugin = importlib.import_module(module_path)
    except Exception as exc:
        if isinstance(exc, ModuleNotFoundError) and exc.name and _is_same_or_parent(exc.name, module_path):
            reason = f"module {module_path!r} does not exist (ModuleNotFoundError: no module {exc.name!r})"
        else:
            reason = f"import of module {module_path!r} failed: {_described(exc)}"
        _fail(pm, info, reason, exc)
        return
    _register(pm, info, plugin)


def _register(pm: EnginePluginManager, info: PluginInfo, plugin: Any) -> None:
    try:
        pm.register(plugin, name=info.name)
    except ValueError as exc:  # the same object or name registered twice
        _fail(pm, info, f"registration failed: {exc}", exc)
        return
    except pluggy.PluginValidationError as exc:  # a hook implemented with arguments its spec lacks
        _fail(pm, info, f"registration failed: {exc}", exc)
        return
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        unknown = sorted(caller.name for caller in pm.get_hookcallers(plugin) or [] if not caller.has_spec())
        pm.unregister(plugin)
        _fail(pm, info, _unknown_hooks_message(pm, unknown), exc)
        return
    except Exception as exc:
        pm.unregister(plugin)
        _fail(pm, info, f"validation failed: {exc}", exc)
        return
    info.loaded = True
    info.hooks = sorted(caller.name for caller in pm.get_hookcallers(plugin) or [])


def _unknown_hooks_message(pm: EnginePluginManager, unknown: list[str]) -> str:
    """``unknown hook 'register_modles' (did you mean 'register_models'?). Known hooks: ...``"""
    known = sorted(name for name in dir(pm.hook) if name.startswith("register_") and getattr(pm.hook, name).has_spec())
    parts = []
    for name in unknown:
        close = difflib.get_close_matches(name, known, n=1)
        parts.append(f"unknown hook {name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return f"{', '.join(parts)}. Known hooks: {', '.join(known)}"


def _fail(pm: EnginePluginManager, info: PluginInfo, reason: str, cause: BaseException) -> None:
    reason = clause(reason)
    info.error = reason
    who = f"Plugin {info.name!r} ({info.distribution_label})"
    if pm.trace_enabled:
        logger.info("%s: traceback of its failure\n%s", who, "".join(traceback.format_exception(cause)).rstrip())
    if info.requested:
        raise PluginLoadError(f"{who} could not be loaded: {reason}.") from cause
    message = f"{who} failed to load and was skipped: {reason}. Run `engine plugins` for details."
    warnings.warn(message, PluginLoadWarning, stacklevel=4)
    logger.warning(message)
