"""The nine component registries, filled by calling the registration hooks through pluggy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import pluggy

from engine.kernels import BUILTIN_ATTENTION_BACKENDS
from engine.kv_tiers import BUILTIN_KV_TIERS
from engine.plugins.errors import PluginLoadError
from engine.plugins.registry import BUILT_IN, ComponentError, Registry
from engine.spec_decode import BUILTIN_SPEC_PROPOSERS


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


class Components:
    """What the loaded plugins registered, one :class:`Registry` per kind."""

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
        for kind in KINDS:
            setattr(self, kind.attr, Registry(kind.label, kind.interface, kind.option))

    def registry(self, attr: str) -> Registry[Any]:
        return getattr(self, attr)

    @classmethod
    def from_plugin_manager(cls, pm: pluggy.PluginManager, distribution_label: Callable[[str], str]) -> Components:
        """Call every registration hook through ``pm`` and return the filled registries.

        ``distribution_label(plugin_name)`` names the distribution in registry entries
        and errors. Each hook is called once per plugin, in the order of
        ``get_hookimpls()`` (the order decides duplicates and overrides), with a
        ``register`` callback of its own; ``pm.subset_hook_caller`` leaves the other
        registering plugins out of that call, so wrappers and call monitors see one
        call per plugin. :attr:`added_by` records what each call added.
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
            components._call_registration_hook(pm, kind, distribution_label)
        return components

    def _call_registration_hook(
        self, pm: pluggy.PluginManager, kind: ComponentKind, distribution_label: Callable[[str], str]
    ) -> None:
        registry = self.registry(kind.attr)
        registering: dict[str, Any] = {}  # plugin name -> plugin object, in hookimpl order
        for impl in getattr(pm.hook, kind.hook).get_hookimpls():
            if not (impl.hookwrapper or impl.wrapper):
                registering.setdefault(impl.plugin_name, impl.plugin)
        for plugin_name, plugin in registering.items():
            distribution = distribution_label(plugin_name)
            register = Registration(registry, plugin_name, distribution)
            others = [other for other in registering.values() if other is not plugin]
            try:
                pm.subset_hook_caller(kind.hook, remove_plugins=others)(register=register)
            except ComponentError:
                raise
            except Exception as exc:
                raise PluginLoadError(
                    f"Plugin {plugin_name!r} ({distribution}) failed in {kind.hook}: {type(exc).__name__}: {exc}"
                ) from exc
            self.added_by.setdefault(plugin_name, {}).setdefault(kind.attr, []).extend(register.added)


class Registration:
    """The ``register`` callback one plugin receives in one call of a registration hook.

    :attr:`added` lists, sorted, the names this call put into the registry that were
    not there before (a name it overrides stays with the plugin that added it first).
    """

    def __init__(self, registry: Registry[Any], plugin: str, distribution: str) -> None:
        self.registry = registry
        self.plugin = plugin
        self.distribution = distribution
        self._added: set[str] = set()

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
        is_new = name not in self.registry
        self.registry.add(name, target, plugin=self.plugin, distribution=self.distribution, override=override)
        if is_new:
            self._added.add(name)
