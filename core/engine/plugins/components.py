"""The six component registries, filled by calling the registration hooks."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from engine.plugins.errors import PluginLoadError
from engine.plugins.registry import BUILT_IN, ComponentError, Registry

if TYPE_CHECKING:
    from engine.plugins.manager import EnginePluginManager

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
        "quantizers", "register_quantizers", "quantization method", "engine.interfaces.quantizer:Quantizer", "--quantization"
    ),
    ComponentKind(
        "spec_proposers",
        "register_spec_proposers",
        "speculative method",
        "engine.interfaces.spec_proposer:SpecProposer",
        "--speculative-method",
    ),
    ComponentKind("kv_tiers", "register_kv_tiers", "KV tier", "engine.interfaces.kv_tier:KVTier", "--kv-tier"),
)


class Components:
    """What the loaded plugins registered, one :class:`Registry` per kind."""

    platforms: Registry[Any]
    models: Registry[Any]
    attention_backends: Registry[Any]
    quantizers: Registry[Any]
    spec_proposers: Registry[Any]
    kv_tiers: Registry[Any]

    def __init__(self) -> None:
        for kind in KINDS:
            setattr(self, kind.attr, Registry(kind.label, kind.interface, kind.option))

    def registry(self, attr: str) -> Registry[Any]:
        return getattr(self, attr)

    @classmethod
    def from_plugin_manager(cls, pm: EnginePluginManager) -> Components:
        from engine.kernels import BUILTIN_ATTENTION_BACKENDS
        from engine.kv_tiers import BUILTIN_KV_TIERS
        from engine.spec_decode import BUILTIN_SPEC_PROPOSERS

        components = cls()
        for registry, builtins in ((components.kv_tiers, BUILTIN_KV_TIERS),
                                   (components.spec_proposers, BUILTIN_SPEC_PROPOSERS),
                                   (components.attention_backends, BUILTIN_ATTENTION_BACKENDS)):
            for name, target in builtins.items():  # part of the engine: no plugin needed
                registry.add(name, target, plugin=BUILT_IN, distribution="engine (built in)")
        for kind in KINDS:
            registry = components.registry(kind.attr)
            for impl in getattr(pm.hook, kind.hook).get_hookimpls():
                info = pm.info_for(impl.plugin_name)
                callback = _make_register(registry, impl.plugin_name, info.distribution_label if info else "?")
                if pm.trace_enabled:
                    logger.info("hook %s: calling plugin %r", kind.hook, impl.plugin_name)
                before = set(registry.names())
                try:
                    impl.function(register=callback)
                except ComponentError:
                    raise
                except Exception as exc:
                    raise PluginLoadError(
                        f"Plugin {impl.plugin_name!r} ({info.distribution_label if info else '?'}) failed in "
                        f"{kind.hook}: {type(exc).__name__}: {exc}"
                    ) from exc
                added = sorted(set(registry.names()) - before)
                if info is not None:
                    info.components.setdefault(kind.attr, []).extend(added)
                if pm.trace_enabled:
                    logger.info("hook %s: plugin %r registered %s", kind.hook, impl.plugin_name, added)
        return components


def _make_register(registry: Registry[Any], plugin: str, distribution: str) -> Callable[..., None]:
    def register(name_or_component: Any, component: Any = None, *, override: bool = False) -> None:
        if component is None:
            target = name_or_component
            name = getattr(target, "name", None) if isinstance(target, type) else None
            if not isinstance(name, str):
                raise ComponentError(
                    f"Plugin {plugin!r} called register({target!r}) for a {registry.kind}: a single "
                    f"argument must be a class with a string 'name' attribute; otherwise call "
                    f"register('name', component)."
                )
        else:
            name, target = name_or_component, component
        registry.add(name, target, plugin=plugin, distribution=distribution, override=override)

    return register
