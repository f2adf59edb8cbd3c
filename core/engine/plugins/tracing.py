"""``ENGINE_TRACE_PLUGINS``: a pluggy call monitor that logs every hook call and its results."""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Sequence

import pluggy

from engine.plugins.components import Registration

logger = logging.getLogger("engine.plugins")


def enable_tracing(pm: pluggy.PluginManager) -> Callable[[], None]:
    """Log each call of each hook of ``pm`` on the ``engine.plugins`` logger (at INFO).

    Before a call: which plugins it calls and which wrap it. After: for a
    registration hook what the plugin registered, for any other hook what it
    returned, or what it raised. Returns pluggy's undo function.
    """

    def before(hook_name: str, hook_impls: Sequence[pluggy.HookImpl], kwargs: Mapping[str, Any]) -> None:
        for impl in hook_impls:
            if impl.hookwrapper or impl.wrapper:
                logger.info("hook %s: wrapped by plugin %r", hook_name, impl.plugin_name)
            else:
                logger.info("hook %s: calling plugin %r", hook_name, impl.plugin_name)

    def after(
        outcome: pluggy.Result[Any], hook_name: str, hook_impls: Sequence[pluggy.HookImpl], kwargs: Mapping[str, Any]
    ) -> None:
        register = kwargs.get("register")
        if outcome.exception is not None:
            called = [impl.plugin_name for impl in hook_impls if not (impl.hookwrapper or impl.wrapper)]
            exc = outcome.exception
            logger.info("hook %s: plugins %s raised %s: %s", hook_name, called, type(exc).__name__, exc)
        elif isinstance(register, Registration):
            logger.info("hook %s: plugin %r registered %s", hook_name, register.plugin, register.added)
        else:
            logger.info("hook %s returned %r", hook_name, outcome.get_result())

    undo = pm.add_hookcall_monitoring(before, after)
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return undo
