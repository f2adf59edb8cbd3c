"""Registration hooks are called through pluggy: hook wrappers and call monitors see every
call (one per registering plugin, in load order), ``ENGINE_TRACE_PLUGINS`` logs them through
a pluggy monitor, and errors still name the plugin. The plugin modules import one way."""

from __future__ import annotations

import ast
import logging
import sys
from pathlib import Path

import pytest

import engine.plugins
from engine.plugins.components import KINDS
from engine.plugins.manager import PluginLoadError, get_plugin_manager
from engine.plugins.registry import ComponentError

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))
from plugin_helpers import PluginFactory, hooks_source  # noqa: E402

PLUGINS_PACKAGE = Path(engine.plugins.__file__).parent

WRAPPER_STYLES = {
    # pluggy's old-style wrapper: gets a Result at the yield
    "hookwrapper": """
        import engine

        SEEN = []

        @engine.hookimpl(hookwrapper=True)
        def {hook}(register):
            SEEN.append(("{hook}", "before", register.plugin))
            outcome = yield
            SEEN.append(("{hook}", "after", register.plugin, register.added, outcome.exception))
    """,
    # the new style: the yield returns the result or raises the impl's exception
    "wrapper": """
        import engine

        SEEN = []

        @engine.hookimpl(wrapper=True)
        def {hook}(register):
            SEEN.append(("{hook}", "before", register.plugin))
            try:
                result = yield
            except Exception as exc:
                SEEN.append(("{hook}", "after", register.plugin, register.added, exc))
                raise
            SEEN.append(("{hook}", "after", register.plugin, register.added, None))
            return result
    """,
}


def tier_plugin(factory: PluginFactory, base: str, *tiers: str) -> str:
    body = "\n".join(f'register("{tier}", "nowhere_{factory.suffix}:Tier")' for tier in tiers)
    return factory.plugin(base, hooks_source(register_kv_tiers=body), dist=f"{base}-dist", version="1.0")


def wrapper_plugin(factory: PluginFactory, style: str, hook: str = "register_kv_tiers") -> str:
    return factory.plugin(f"wrap_{style}", WRAPPER_STYLES[style].format(hook=hook), dist="wrap-dist")


def trace_messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "engine.plugins"]


# -------------------------------------------------------------------------
# hook wrappers
# -------------------------------------------------------------------------


@pytest.mark.parametrize("style", sorted(WRAPPER_STYLES))
def test_a_wrapper_sees_each_plugins_registration_call_in_load_order(factory, style):
    first = tier_plugin(factory, "first", "b", "a")
    second = tier_plugin(factory, "second", "c")
    wrap = wrapper_plugin(factory, style)

    pm = get_plugin_manager(plugins=[first, second, wrap])
    components = pm.components()

    assert sys.modules[wrap].SEEN == [
        ("register_kv_tiers", "before", first),
        ("register_kv_tiers", "after", first, ["a", "b"], None),
        ("register_kv_tiers", "before", second),
        ("register_kv_tiers", "after", second, ["c"], None),
    ]
    assert components.kv_tiers.entry("a").plugin == first and components.kv_tiers.entry("c").plugin == second
    assert pm.info_for(wrap).components == {}  # a wrapper registers nothing of its own


@pytest.mark.parametrize("style", sorted(WRAPPER_STYLES))
def test_a_wrapper_sees_a_failing_call_and_the_error_still_names_the_plugin(factory, style):
    source = """
        import engine

        @engine.hookimpl
        def register_kv_tiers(register):
            raise ValueError("misconfigured tier")
    """
    raising = factory.plugin("raising", source, dist="raising-dist", version="2.0")
    wrap = wrapper_plugin(factory, style)
    pm = get_plugin_manager(plugins=[raising, wrap])

    with pytest.raises(PluginLoadError) as excinfo:
        pm.components()

    message = str(excinfo.value)
    assert message.startswith(f"Plugin {raising!r} (raising-dist 2.0) failed in register_kv_tiers: ")
    assert "ValueError: misconfigured tier" in message and wrap not in message
    (_, (hook, when, plugin, added, exc)) = sys.modules[wrap].SEEN
    assert (hook, when, plugin, added) == ("register_kv_tiers", "after", raising, [])
    assert isinstance(exc, ValueError)


def test_a_duplicate_through_pluggy_is_still_a_component_error_naming_both(factory):
    first = tier_plugin(factory, "first", "dup")
    second = tier_plugin(factory, "second", "dup")
    wrap = wrapper_plugin(factory, "wrapper")
    pm = get_plugin_manager(plugins=[first, second, wrap])

    with pytest.raises(ComponentError) as excinfo:
        pm.components()

    message = str(excinfo.value)
    assert f"registered by plugin {first!r} (distribution first-dist 1.0)" in message
    assert f"and by plugin {second!r} (distribution second-dist 1.0)" in message


# -------------------------------------------------------------------------
# call monitors and ENGINE_TRACE_PLUGINS
# -------------------------------------------------------------------------


def test_a_call_monitor_sees_one_call_per_plugin_and_hook(factory):
    first = tier_plugin(factory, "first", "a")
    second = tier_plugin(factory, "second", "b")
    pm = get_plugin_manager(plugins=[first, second])
    calls = []
    pm.add_hookcall_monitoring(
        lambda hook_name, impls, kwargs: calls.append((hook_name, [impl.plugin_name for impl in impls])),
        lambda outcome, hook_name, impls, kwargs: None,
    )

    pm.components()

    assert calls == [("register_kv_tiers", [first]), ("register_kv_tiers", [second])]


@pytest.mark.parametrize("how", ["env", "argument"])
def test_tracing_logs_each_registration_call_with_what_the_plugin_registered(factory, monkeypatch, caplog, how):
    source = hooks_source(**{kind.hook: f'register("{kind.attr}_x", "nowhere:C")' for kind in KINDS})
    everything = factory.plugin("everything", source)
    tiers = tier_plugin(factory, "tiers", "t2", "t1")
    wrap = wrapper_plugin(factory, "hookwrapper")
    caplog.set_level(logging.INFO, logger="engine.plugins")
    if how == "env":
        monkeypatch.setenv("ENGINE_TRACE_PLUGINS", "1")
        pm = get_plugin_manager(plugins=[everything, tiers, wrap])
    else:
        pm = get_plugin_manager(plugins=[everything, tiers, wrap], trace=True)

    pm.components()

    messages = trace_messages(caplog)
    for kind in KINDS:
        if kind.hook != "register_kv_tiers":
            start = messages.index(f"hook {kind.hook}: calling plugin {everything!r}")
            assert messages[start + 1] == f"hook {kind.hook}: plugin {everything!r} registered ['{kind.attr}_x']"
    start = messages.index(f"hook register_kv_tiers: calling plugin {everything!r}")
    assert messages[start : start + 6] == [
        f"hook register_kv_tiers: calling plugin {everything!r}",
        f"hook register_kv_tiers: wrapped by plugin {wrap!r}",
        f"hook register_kv_tiers: plugin {everything!r} registered ['kv_tiers_x']",
        f"hook register_kv_tiers: calling plugin {tiers!r}",
        f"hook register_kv_tiers: wrapped by plugin {wrap!r}",
        f"hook register_kv_tiers: plugin {tiers!r} registered ['t1', 't2']",
    ]


def test_tracing_logs_what_a_failing_call_raised(factory, caplog):
    source = """
        import engine

        @engine.hookimpl
        def register_models(register):
            raise RuntimeError("no weights here")
    """
    raising = factory.plugin("raising", source, dist="raising-dist")
    caplog.set_level(logging.INFO, logger="engine.plugins")
    pm = get_plugin_manager(plugins=[raising], trace=True)

    with pytest.raises(PluginLoadError, match=f"Plugin {raising!r} \\(raising-dist 1.0\\) failed in register_models"):
        pm.components()

    assert f"hook register_models: plugins [{raising!r}] raised RuntimeError: no weights here" in trace_messages(caplog)


# -------------------------------------------------------------------------
# import graph of engine.plugins
# -------------------------------------------------------------------------


def plugin_module_imports() -> dict[str, set[str]]:
    """engine.plugins.<module> -> the engine.plugins modules it imports anywhere in its source
    (top level, functions, TYPE_CHECKING blocks alike)."""
    names = {f"engine.plugins.{path.stem}" for path in PLUGINS_PACKAGE.glob("*.py") if path.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for name in names:
        tree = ast.parse((PLUGINS_PACKAGE / f"{name.rsplit('.', 1)[1]}.py").read_text(encoding="utf-8"))
        imported: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module)
                imported.update(f"{node.module}.{alias.name}" for alias in node.names)
        graph[name] = imported & names
    return graph


def test_the_plugin_modules_import_each_other_without_a_cycle():
    graph = plugin_module_imports()
    assert {"engine.plugins.manager", "engine.plugins.components", "engine.plugins.errors"} <= set(graph)

    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, f"import cycle: {' -> '.join((*path, module))}"
        if module not in done:
            for imported in sorted(graph[module]):
                visit(imported, (*path, module))
            done.add(module)

    for module in sorted(graph):
        visit(module, ())
    assert graph["engine.plugins.errors"] == set()
    assert graph["engine.plugins.registry"] <= {"engine.plugins.qualname"}
    assert not [module for module, imported in graph.items() if "engine.plugins.manager" in imported]
