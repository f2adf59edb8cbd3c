"""Discovery and loading of plugins: selection, autoload, failures, tracing."""

from __future__ import annotations

import importlib.metadata as md
import logging
import sys
import warnings
from pathlib import Path

import pytest

from engine.plugins.components import KINDS
from engine.plugins.manager import PluginLoadError, PluginLoadWarning, get_plugin_manager

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))
from plugin_helpers import REAL_PLUGINS, PluginFactory, hooks_source  # noqa: E402


def tier_plugin(factory: PluginFactory, base: str, tier: str = "tier", **kwargs) -> str:
    """An installed plugin that registers one lazy KV tier named ``tier``."""
    source = hooks_source(register_kv_tiers=f'register("{tier}", "nowhere_{factory.suffix}:Tier")')
    return factory.plugin(base, source, **kwargs)


def infos_by_name(pm) -> dict:
    return {info.name: info for info in pm.plugin_infos}


# -------------------------------------------------------------------------
# autoload
# -------------------------------------------------------------------------


def test_autoload_loads_every_discovered_entry_point(factory):
    mine = tier_plugin(factory, "auto", dist="my-auto-dist", version="2.3")

    pm = get_plugin_manager()

    discovered = {ep.name for ep in md.entry_points(group="engine.plugins")}
    assert {mine, *REAL_PLUGINS} <= discovered
    infos = infos_by_name(pm)
    assert set(infos) == discovered
    info = infos[mine]
    assert (info.distribution, info.version, info.source, info.module) == ("my-auto-dist", "2.3", "entry_point", mine)
    assert info.loaded and info.error is None and not info.requested
    assert info.hooks == ["register_kv_tiers"]
    for name, dist in REAL_PLUGINS.items():
        assert infos[name].distribution == dist and infos[name].loaded
    assert pm.load_errors == []

    components = pm.components()
    assert "tier" in components.kv_tiers and "cpu" in components.platforms
    assert info.components == {"kv_tiers": ["tier"]}
    assert components.kv_tiers.entry("tier").distribution == "my-auto-dist 2.3"


def test_autoload_with_a_selection_loads_the_rest_too(factory):
    first = tier_plugin(factory, "first", tier="a")
    second = tier_plugin(factory, "second", tier="b")

    pm = get_plugin_manager([first], autoload=True)

    infos = infos_by_name(pm)
    assert pm.plugin_infos[0].name == first and infos[first].requested
    assert infos[second].loaded and not infos[second].requested
    assert infos["cpu"].loaded


# -------------------------------------------------------------------------
# selection
# -------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["list", "comma string", "env"])
def test_selection_loads_exactly_the_named_plugins(factory, monkeypatch, form):
    x = tier_plugin(factory, "x", tier="x")
    y = tier_plugin(factory, "y", tier="y")
    tier_plugin(factory, "z", tier="z")

    if form == "list":
        pm = get_plugin_manager(plugins=[x, y])
    elif form == "comma string":
        pm = get_plugin_manager(plugins=f" {x} , {y},")
    else:
        monkeypatch.setenv("ENGINE_PLUGINS", f"{x},{y}")
        pm = get_plugin_manager()

    assert [info.name for info in pm.plugin_infos] == [x, y]
    assert all(info.loaded and info.requested for info in pm.plugin_infos)
    assert pm.components().kv_tiers.names() == ["cpu", "x", "y"]  # cpu: built into the engine
    assert len(pm.components().platforms) == 0  # cpu was not loaded


def test_explicit_selection_takes_precedence_over_env(factory, monkeypatch):
    x = tier_plugin(factory, "x")
    monkeypatch.setenv("ENGINE_PLUGINS", "cpu")

    pm = get_plugin_manager(plugins=x)

    assert [info.name for info in pm.plugin_infos] == [x]


@pytest.mark.parametrize("form", ["empty string", "blank items", "empty list", "empty env"])
def test_empty_selection_loads_no_plugin(factory, monkeypatch, form):
    tier_plugin(factory, "unwanted")
    if form == "empty env":
        monkeypatch.setenv("ENGINE_PLUGINS", "")
        pm = get_plugin_manager()
    else:
        pm = get_plugin_manager(plugins={"empty string": "", "blank items": " , ", "empty list": []}[form])

    assert pm.plugin_infos == []
    components = pm.components()
    built_in = {
        "kv_tiers": ["cpu"],
        "spec_proposers": ["draft", "mtp", "ngram"],
        "attention_backends": ["triton_kda", "triton_mamba2", "triton_mla", "triton_paged"],
    }
    for kind in KINDS:  # only what the engine ships itself
        assert components.registry(kind.attr).names() == built_in.get(kind.attr, []), kind.attr


def test_dotted_module_path_loads_without_entry_point(factory):
    module = factory.module(
        f"pkg_{factory.suffix}.hooks",
        hooks_source(register_kv_tiers=f'register("modtier", "nowhere_{factory.suffix}:Tier")'),
    )

    pm = get_plugin_manager(plugins=module)

    (info,) = pm.plugin_infos
    assert (info.name, info.source, info.distribution, info.loaded) == (module, "module", None, True)
    entry = pm.components().kv_tiers.entry("modtier")
    assert entry.plugin == module and entry.distribution == f"module {module}"


def test_nonexistent_dotted_module_path_is_an_error(factory):
    missing = f"pkg_{factory.suffix}.nope"
    with pytest.raises(PluginLoadError) as excinfo:
        get_plugin_manager(plugins=missing)
    message = str(excinfo.value)
    assert f"Plugin {missing!r}" in message
    assert "ModuleNotFoundError" in message


def test_unknown_plugin_name_lists_installed_plugins(factory):
    mine = tier_plugin(factory, "present")
    with pytest.raises(PluginLoadError) as excinfo:
        get_plugin_manager(plugins="nosuchplugin")
    message = str(excinfo.value)
    assert message.startswith("Unknown plugin 'nosuchplugin'. Installed plugins: ")
    for name in (mine, *REAL_PLUGINS):
        assert name in message


def test_entry_point_name_from_two_distributions_is_an_error_when_requested(factory):
    name = factory.name("twice")
    factory.module(name, hooks_source())
    factory.distribution("dist-one", {name: name})
    factory.distribution("dist-two", {name: name})

    with pytest.raises(PluginLoadError, match="more than one distribution") as excinfo:
        get_plugin_manager(plugins=name)
    assert "dist-one" in str(excinfo.value) and "dist-two" in str(excinfo.value)


def test_entry_point_name_from_two_distributions_skips_both_when_autoloaded(factory):
    name = factory.name("twice")
    factory.module(name, hooks_source(register_kv_tiers='register("twice_tier", "nowhere:Tier")'))
    factory.distribution("dist-one", {name: name})
    factory.distribution("dist-two", {name: name})

    with pytest.warns(PluginLoadWarning, match="more than one distribution") as record:
        pm = get_plugin_manager()
    message = str(record[0].message)
    assert "dist-one" in message and "dist-two" in message and "neither was loaded" in message
    both = [info for info in pm.plugin_infos if info.name == name]
    assert sorted(info.distribution for info in both) == ["dist-one", "dist-two"]
    assert all(not info.loaded and info.error == message for info in both)
    components = pm.components()  # the others load and register as usual
    assert "twice_tier" not in components.kv_tiers and "cpu" in components.platforms


# -------------------------------------------------------------------------
# failures
# -------------------------------------------------------------------------

BROKEN = 'raise RuntimeError("boom: libfoo.so not found")\n'


def test_broken_requested_plugin_is_an_error_naming_plugin_distribution_and_cause(factory):
    broken = factory.plugin("broken", BROKEN, dist="broken-dist", version="0.9")

    with pytest.raises(PluginLoadError) as excinfo:
        get_plugin_manager(plugins=["cpu", broken])

    message = str(excinfo.value)
    assert f"Plugin {broken!r} (broken-dist 0.9) could not be loaded" in message
    assert "RuntimeError: boom: libfoo.so not found" in message
    assert isinstance(excinfo.value.__cause__, RuntimeError)


def test_broken_autoloaded_plugin_warns_and_the_rest_load(factory):
    broken = factory.plugin("broken", BROKEN, dist="broken-dist", version="0.9")
    good = tier_plugin(factory, "good")

    with pytest.warns(PluginLoadWarning) as record:
        pm = get_plugin_manager()

    messages = [str(w.message) for w in record if issubclass(w.category, PluginLoadWarning)]
    assert len(messages) == 1
    assert f"Plugin {broken!r} (broken-dist 0.9) failed to load and was skipped" in messages[0]
    assert "boom: libfoo.so not found" in messages[0]
    infos = infos_by_name(pm)
    assert infos[broken].loaded is False and "boom: libfoo.so not found" in infos[broken].error
    assert pm.load_errors == [infos[broken]]
    assert infos[good].loaded and infos["cpu"].loaded and infos["llama"].loaded
    components = pm.components()
    assert components.platforms.get("cpu").__name__ == "CpuPlatform"
    assert "tier" in components.kv_tiers and "LlamaForCausalLM" in components.models


TYPO = hooks_source(
    register_modles='register("TypoForCausalLM", "nowhere:Model")',
    register_kv_tiers='register("typo_tier", "nowhere:Tier")',
)


def test_typo_hookimpl_in_requested_plugin_is_an_error(factory):
    typo = factory.plugin("typo", TYPO)

    with pytest.raises(PluginLoadError) as excinfo:
        get_plugin_manager(plugins=typo)

    message = str(excinfo.value)
    assert f"Plugin {typo!r}" in message and "could not be loaded" in message
    assert "unknown hook 'register_modles'" in message
    assert "register_models" in message  # the known hooks are listed


def test_typo_hook_is_not_listed_among_known_hooks(factory):
    typo = factory.plugin("typo", TYPO)

    with pytest.raises(PluginLoadError) as excinfo:
        get_plugin_manager(plugins=typo)

    known = str(excinfo.value).partition("Known hooks:")[2]
    assert "register_models" in known and "register_modles" not in known


def test_typo_hookimpl_in_autoloaded_plugin_warns_and_is_skipped(factory):
    typo = factory.plugin("typo", TYPO)
    good = tier_plugin(factory, "good")

    with pytest.warns(PluginLoadWarning, match="register_modles"):
        pm = get_plugin_manager()

    infos = infos_by_name(pm)
    assert infos[typo].loaded is False and "register_modles" in infos[typo].error
    assert infos[good].loaded and infos["cpu"].loaded
    components = pm.components()
    assert "typo_tier" not in components.kv_tiers  # its valid hooks are skipped too
    assert "tier" in components.kv_tiers and "cpu" in components.platforms


def test_typo_hook_gets_a_did_you_mean(factory):
    typo = factory.plugin("typo", TYPO)

    with pytest.raises(PluginLoadError) as excinfo:
        get_plugin_manager(plugins=typo)

    message = str(excinfo.value)
    assert message.startswith(
        f"Plugin {typo!r} (dist-typo-{factory.suffix} 1.0) could not be loaded: "
        "unknown hook 'register_modles' (did you mean 'register_models'?). Known hooks: "
    )
    assert "<module" not in message and ".." not in message and message.endswith(".")


def test_import_error_names_the_file_and_line_that_raised_and_how_to_see_the_traceback(factory):
    source = 'import os\n\n\ndef helper():\n    raise RuntimeError("boom: libfoo.so not found.")\n\n\nhelper()\n'
    broken = factory.plugin("broken", source, dist="broken-dist", version="0.9")
    path = factory.root / f"{broken}.py"

    with pytest.raises(PluginLoadError) as excinfo:
        get_plugin_manager(plugins=broken)

    assert str(excinfo.value) == (
        f"Plugin {broken!r} (broken-dist 0.9) could not be loaded: import of {broken!r} failed: RuntimeError: "
        f"boom: libfoo.so not found (raised at {path}:5). Set ENGINE_TRACE_PLUGINS=1 to see the traceback."
    )


def test_a_syntax_error_points_at_its_line(factory):
    broken = factory.plugin("broken", "x = 1\ndef f(:\n    pass\n")
    with pytest.raises(PluginLoadError, match=rf"SyntaxError: .*\(raised at .*{broken}\.py:2\)"):
        get_plugin_manager(plugins=broken)


def test_a_missing_dependency_is_told_apart_from_a_missing_entry_point_module(factory):
    needs = factory.plugin("needs", "import libfoo_that_is_not_installed\n", dist="needs-dist")
    with pytest.raises(PluginLoadError) as excinfo:
        get_plugin_manager(plugins=needs)
    message = str(excinfo.value)
    assert "ModuleNotFoundError: No module named 'libfoo_that_is_not_installed'" in message
    assert f"(raised at {factory.root / needs}.py:1)" in message and "does not exist" not in message


@pytest.mark.parametrize("autoloaded", [False, True])
def test_an_entry_point_naming_a_module_that_does_not_exist_says_so(factory, autoloaded):
    name = factory.name("ghost")
    factory.distribution("ghost-dist", {name: f"{name}_pkg.hooks"})
    if autoloaded:
        with pytest.warns(PluginLoadWarning) as record:
            pm = get_plugin_manager()
        message = str(record[0].message)
        assert pm.info_for(name).loaded is False and "cpu" in pm.components().platforms
    else:
        with pytest.raises(PluginLoadError) as excinfo:
            get_plugin_manager(plugins=name)
        message = str(excinfo.value)
    assert (
        f"entry point {name!r} of distribution 'ghost-dist' names module '{name}_pkg.hooks', which does not "
        f"exist (no module '{name}_pkg'). Reinstall the distribution, or fix the module path in its entry points."
    ) in message
    assert ".." not in message


def test_an_entry_point_naming_a_missing_attribute_says_so(factory):
    name = factory.name("attr")
    factory.module(name, "x = 1\n")
    factory.distribution("attr-dist", {name: f"{name}:hooks"})
    with pytest.raises(PluginLoadError) as excinfo:
        get_plugin_manager(plugins=name)
    assert (
        f"entry point {name!r} of distribution 'attr-dist' names '{name}:hooks', but module {name!r} has no "
        "attribute 'hooks'."
    ) in str(excinfo.value)


def test_tracing_logs_the_traceback_of_a_failing_plugin(factory, monkeypatch, caplog):
    factory.plugin("broken", 'def deep():\n    raise RuntimeError("deep failure")\n\n\ndeep()\n')
    monkeypatch.setenv("ENGINE_TRACE_PLUGINS", "1")
    with caplog.at_level(logging.INFO, logger="engine.plugins"), pytest.warns(PluginLoadWarning):
        get_plugin_manager()
    (record,) = [r for r in caplog.records if "traceback of its failure" in r.getMessage()]
    text = record.getMessage()
    assert "Traceback (most recent call last)" in text and "in deep" in text and "RuntimeError: deep failure" in text


# -------------------------------------------------------------------------
# tracing
# -------------------------------------------------------------------------

ALL_HOOKS = hooks_source(**{kind.hook: f'register("{kind.attr}_x", "nowhere:C")' for kind in KINDS})


@pytest.mark.parametrize("how", ["env", "argument"])
def test_tracing_logs_every_hook_call_and_its_registrations(factory, monkeypatch, caplog, how):
    traced = factory.plugin("traced", ALL_HOOKS)
    caplog.set_level(logging.INFO, logger="engine.plugins")
    if how == "env":
        monkeypatch.setenv("ENGINE_TRACE_PLUGINS", "1")
        pm = get_plugin_manager(plugins=traced)
    else:
        pm = get_plugin_manager(plugins=traced, trace=True)
    pm.components()

    messages = [r.getMessage() for r in caplog.records if r.name == "engine.plugins"]
    for kind in KINDS:
        assert f"hook {kind.hook}: calling plugin {traced!r}" in messages
        assert f"hook {kind.hook}: plugin {traced!r} registered ['{kind.attr}_x']" in messages


def test_no_hook_logging_without_tracing(factory, caplog):
    plain = factory.plugin("plain", ALL_HOOKS)
    caplog.set_level(logging.INFO, logger="engine.plugins")

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        get_plugin_manager(plugins=plain).components()

    assert not [r for r in caplog.records if r.name == "engine.plugins"]


def test_a_hook_that_raises_is_reported_with_the_plugin(factory):
    source = """
        import engine

        @engine.hookimpl
        def register_kv_tiers(register):
            raise ValueError("misconfigured tier")
    """
    name = factory.plugin("raising", source, dist="raising-dist", version="2.0")
    pm = get_plugin_manager(plugins=[name])
    with pytest.raises(PluginLoadError) as excinfo:
        pm.components()
    message = str(excinfo.value)
    assert f"Plugin {name!r} (raising-dist 2.0) failed in register_kv_tiers" in message
    assert "ValueError: misconfigured tier" in message


# -------------------------------------------------------------------------
# engine version ranges
# -------------------------------------------------------------------------


def test_plugin_for_another_engine_range_loads_with_a_clear_warning(factory):
    from engine.plugins.manager import PluginVersionWarning
    from engine.version import __version__

    plugin = factory.plugin(
        "future", "x = 1\n", dist="engine-future", version="3.0", requires=("torch>=2", "engine>=9,<10")
    )
    with pytest.warns(PluginVersionWarning) as record:
        pm = get_plugin_manager(plugins=plugin)
    message = str(record[0].message)
    assert f"Plugin {plugin!r} (engine-future 3.0) supports engine<10,>=9" in message
    assert f"this is engine {__version__}" in message
    assert pm.info_for(plugin).loaded


def test_plugin_within_its_engine_range_loads_silently(factory, recwarn):
    plugin = factory.plugin("current", "x = 1\n", requires=("engine>=0.1,<0.2", 'engine<0 ; python_version < "3"'))
    get_plugin_manager(plugins=plugin)
    assert not [w for w in recwarn if "supports engine" in str(w.message)]
