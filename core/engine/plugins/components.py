"""The nine component registries, filled by calling the registration hooks through pluggy."""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import pluggy

from engine.kernels import BUILTIN_ATTENTION_BACKENDS
from engine.kv_tiers import BUILTIN_KV_TIERS
from engine.plugins.errors import PluginLoadError, PluginLoadWarning, clause
from engine.plugins.registry import BUILT_IN, ComponentError, DuplicateComponentError, Registry, RegistryEntry
from engine.spec_decode import BUILTIN_SPEC_PROPOSERS

logger = logging.getLogger("engine.plugins")


@dataclass(frozen=True)
class ComponentKind:
    attr: str  # attribute on Components
    hook: str  # registration hook name
    label: str  # human label used in messages
    interface: str  # module:Class of the ABC
    option: str | None  # the CLI option that accepts a name of this kind


KINDS: tuple[ComponentKind, ...] = (
    ComponentKind("platforms", "register_platforms", "platform", "engine.interfaces.platform:Platform", "--device"),
    ComponentKind("models", "register_models", "model architecture", "engine.interfaces.model:Model", None),
    ComponentKind(
        "attention_backends",
        "register_attention_backends",
        "attention backend",
        "engine.interfaces.attention:AttentionBackend",
        "--attention-backend",
    ),
    ComponentKind(
        "quantizers",
        "register_quantizers",
        "quantization method",
        "engine.interfaces.quantizer:Quantizer",
        "--quantization",
    ),
    ComponentKind(
        "spec_proposers",
        "register_spec_proposers",
        "speculative method",
        "engine.interfaces.spec_proposer:SpecProposer",
        "--speculative-method",
    ),
    ComponentKind("kv_tiers", "register_kv_tiers", "KV tier", "engine.interfaces.kv_tier:KVTier", "--kv-tier"),
    ComponentKind(
        "structured_output_backends",
        "register_structured_output_backends",
        "structured-output backend",
        "engine.interfaces.structured_output:StructuredOutputBackend",
        "--structured-output-backend",
    ),
    ComponentKind(
        "tool_parsers",
        "register_tool_parsers",
        "tool-call parser",
        "engine.interfaces.tool_parser:ToolParser",
        "--tool-call-parser",
    ),
    ComponentKind(
        "reasoning_parsers",
        "register_reasoning_parsers",
        "reasoning parser",
        "engine.interfaces.reasoning_parser:ReasoningParser",
        "--reasoning-parser",
    ),
)


@dataclass(frozen=True)
class Replacement:
    """A component a plugin registered with ``override=True`` over another's (or the engine's)."""

    kind: str  # the Components attribute
    name: str
    plugin: str  # the plugin that replaced it
    previous: RegistryEntry


class Components:
    """What the loaded plugins registered, one :class:`Registry` per kind.

    :attr:`added_by` records the names each plugin added, :attr:`replacements` the
    components a plugin replaced with ``override=True``, and :attr:`problems` what was
    skipped for each autoloaded plugin (a failing hook, a duplicate name), each also
    warned as a :class:`PluginLoadWarning`.
    """

    platforms: Registry[Any]
    models: Registry[Any]
    attention_backends: Registry[Any]
    quantizers: Registry[Any]
    spec_proposers: Registry[Any]
    kv_tiers: Registry[Any]
    structured_output_backends: Registry[Any]
    tool_parsers: Registry[Any]
    reasoning_parsers: Registry[Any]

    def __init__(self) -> None:
        self.added_by: dict[str, dict[str, list[str]]] = {}  # plugin -> kind attr -> names it added
        self.replacements: list[Replacement] = []
        self.problems: dict[str, list[str]] = {}  # plugin -> what was skipped, and why
        for kind in KINDS:
            setattr(self, kind.attr, Registry(kind.label, kind.interface, kind.option))

    def registry(self, attr: str) -> Registry[Any]:
        return getattr(self, attr)

    @classmethod
    def from_plugin_manager(
        cls,
        pm: pluggy.PluginManager,
        distribution_label: Callable[[str], str],
        autoloaded: Callable[[str], bool] = lambda plugin: False,
    ) -> Components:
        """Call every registration hook through ``pm`` and return the filled registries.

        ``distribution_label(plugin_name)`` names the distribution in registry entries
        and errors. Each hook is called once per plugin, in the order of
        ``get_hookimpls()`` (the order decides duplicates and overrides), with a
        ``register`` callback of its own; ``pm.subset_hook_caller`` leaves the other
        registering plugins out of that call, so wrappers and call monitors see one
        call per plugin. :attr:`added_by` records what each call added.

        For a plugin that ``autoloaded(plugin_name)`` says was not asked for, a hook that
        raises or a name it cannot have is skipped with a warning (and kept in
        :attr:`problems`) instead of raised: one broken plugin never stops the others.
        """
        components = cls()
        for registry, builtins in (
            (components.kv_tiers, BUILTIN_KV_TIERS),
            (components.spec_proposers, BUILTIN_SPEC_PROPOSERS),
            (components.attention_backends, BUILTIN_ATTENTION_BACKENDS),
        ):
            for name, target in builtins.items():  # part of the engine: no plugin needed
                registry.add(name, target, plugin=BUILT_IN, distribution="engine (built in)")
        for kind in KINDS:
            components._call_registration_hook(pm, kind, distribution_label, autoloaded)
        return components

    def take_away(self, plugin: str, kind: str, name: str) -> None:
        """``plugin`` no longer holds the ``kind`` component ``name`` it added."""
        names = self.added_by.get(plugin, {}).get(kind, [])
        if name in names:
            names.remove(name)

    def skip(self, plugin: str, message: str) -> None:
        """Record and warn that something of autoloaded ``plugin`` was skipped."""
        self.problems.setdefault(plugin, []).append(message)
        warnings.warn(message, PluginLoadWarning, stacklevel=2)
        logger.warning(message)

    def _call_registration_hook(
        self,
        pm: pluggy.PluginManager,
        kind: ComponentKind,
        distribution_label: Callable[[str], str],
        autoloaded: Callable[[str], bool],
    ) -> None:
        registry = self.registry(kind.attr)
        registering: dict[str, Any] = {}  # plugin name -> plugin object, in hookimpl order
        for impl in getattr(pm.hook, kind.hook).get_hookimpls():
            if not (impl.hookwrapper or impl.wrapper):
                registering.setdefault(impl.plugin_name, impl.plugin)
        for plugin_name, plugin in registering.items():
            distribution = distribution_label(plugin_name)
            register = Registration(
                registry, plugin_name, distribution, components=self, kind=kind.attr, autoloaded=autoloaded
            )
            others = [other for other in registering.values() if other is not plugin]
            before = registry.snapshot()
            try:
                pm.subset_hook_caller(kind.hook, remove_plugins=others)(register=register)
            except Exception as exc:
                if autoloaded(plugin_name):
                    registry.restore(before)
                    self.skip(
                        plugin_name,
                        f"Plugin {plugin_name!r} ({distribution}) failed in {kind.hook}: {type(exc).__name__}: "
                        f"{clause(str(exc))}; nothing it registered there is used.",
                    )
                    continue
                if isinstance(exc, ComponentError):
                    raise
                raise PluginLoadError(
                    f"Plugin {plugin_name!r} ({distribution}) failed in {kind.hook}: {type(exc).__name__}: {exc}"
                ) from exc
            self.added_by.setdefault(plugin_name, {}).setdefault(kind.attr, []).extend(register.added)
            self.replacements.extend(register.replaced)


class Registration:
    """The ``register`` callback one plugin receives in one call of a registration hook.

    :attr:`added` lists, sorted, the names this call put into the registry that were
    not there before (a name it overrides stays with the plugin that added it first);
    :attr:`replaced` the components it replaced with ``override=True``.

    With ``components`` given, a name another plugin holds follows the loading rules:
    between two autoloaded plugins neither keeps it (the name is withdrawn, naming both),
    a plugin that was asked for wins over an autoloaded one, and the engine's built-in
    components are replaced only with ``override=True``; what an autoloaded plugin loses
    is skipped with a warning instead of raised.
    """

    def __init__(
        self,
        registry: Registry[Any],
        plugin: str,
        distribution: str,
        *,
        components: Components | None = None,
        kind: str = "",
        autoloaded: Callable[[str], bool] = lambda plugin: False,
    ) -> None:
        self.registry = registry
        self.plugin = plugin
        self.distribution = distribution
        self.components = components
        self.kind = kind
        self.autoloaded = autoloaded  # whether a plugin was loaded without being asked for
        self._added: set[str] = set()
        self.replaced: list[Replacement] = []

    @property
    def added(self) -> list[str]:
        return sorted(self._added)

    def __call__(self, name_or_component: Any, component: Any = None, *, override: bool = False) -> None:
        if component is None:
            target = name_or_component
            name = getattr(target, "name", None) if isinstance(target, type) else None
            if not isinstance(name, str):
                raise ComponentError(
                    f"Plugin {self.plugin!r} called register({target!r}) for a {self.registry.kind}: a single "
                    f"argument must be a class with a string 'name' attribute; otherwise call "
                    f"register('name', component)."
                )
        else:
            name, target = name_or_component, component
        withdrawn = self.registry.withdrawn(name)
        if withdrawn is not None and self.components is not None and self.autoloaded(self.plugin):
            self.components.skip(self.plugin, f"{withdrawn} Plugin {self.plugin!r} registers it too; skipped.")
            return
        is_new = name not in self.registry
        try:
            previous = self.registry.add(
                name, target, plugin=self.plugin, distribution=self.distribution, override=override
            )
        except DuplicateComponentError as exc:
            if self._settle(name, target, exc):
                self._added.add(name)
            return
        except ComponentError as exc:
            if self.components is None or not self.autoloaded(self.plugin):
                raise
            self.components.skip(self.plugin, f"{exc} It was skipped.")
            return
        if is_new:
            self._added.add(name)
        if previous is not None:
            self._record_replacement(name, previous)

    def _record_replacement(self, name: str, previous: RegistryEntry) -> None:
        self.replaced.append(Replacement(self.kind, name, self.plugin, previous))
        owner = "the engine's built-in" if previous.plugin == BUILT_IN else f"plugin {previous.plugin!r}'s"
        logger.info(
            "Plugin %r (%s) replaces %s %s %r (%s).",
            self.plugin,
            self.distribution,
            owner,
            self.registry.kind,
            name,
            previous.target_repr,
        )

    def _settle(self, name: str, target: Any, exc: DuplicateComponentError) -> bool:
        """Decide a name taken by ``exc.previous``; True when this plugin's ``target`` now holds
        it (replacing the previous one), False when it was skipped or withdrawn."""
        components, previous = self.components, exc.previous
        if components is None:
            raise exc
        mine, theirs = self.autoloaded(self.plugin), previous.plugin != BUILT_IN and self.autoloaded(previous.plugin)
        if not mine and not theirs and previous.plugin != BUILT_IN:
            raise exc  # two plugins that were both asked for
        if not mine and previous.plugin == BUILT_IN:
            raise exc  # asked for, but replacing a built-in needs override=True
        if mine and previous.plugin == BUILT_IN:
            components.skip(self.plugin, f"{exc} It was skipped.")
            return False
        kind = self.registry.kind.capitalize()
        if mine and not theirs:  # the plugin asked for keeps it
            components.skip(
                self.plugin,
                f"{kind} {name!r} of plugin {self.plugin!r} ({self.distribution}) was skipped: plugin "
                f"{previous.plugin!r} ({previous.distribution}), which was asked for, registers it too.",
            )
            return False
        if not mine:  # asked for, over an autoloaded plugin's component
            components.skip(
                previous.plugin,
                f"{kind} {name!r} of plugin {previous.plugin!r} ({previous.distribution}) was skipped: plugin "
                f"{self.plugin!r} ({self.distribution}), which was asked for, registers it too.",
            )
            self.registry.add(name, target, plugin=self.plugin, distribution=self.distribution, override=True)
            components.take_away(previous.plugin, self.kind, name)
            return True
        reason = (
            f"The {self.registry.kind} {name!r} is registered by two plugins, {previous.plugin!r} "
            f"({previous.distribution}) and {self.plugin!r} ({self.distribution}), so neither is used. "
            f"Uninstall one of them, or name the one to use with --plugins."
        )
        self.registry.withdraw(name, reason)
        components.take_away(previous.plugin, self.kind, name)
        for plugin in (previous.plugin, self.plugin):
            components.skip(plugin, reason)
        return False
