"""``engine plugins`` and the promise that the light entry points import no torch."""

from __future__ import annotations

import importlib.metadata as md
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import engine
from engine.cli import main
from engine.version import PLUGIN_API_VERSION

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))
from plugin_helpers import REAL_PLUGINS, PluginFactory, hooks_source  # noqa: E402

LLAMA_ARCHITECTURES = [
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Phi3ForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
]


def torch_tier_plugin(factory: PluginFactory) -> str:
    """A plugin whose KV tier module imports torch; only the tier's first use may import it."""
    tier = factory.module(factory.name("torchtier"), "import torch\n")
    return factory.plugin("torchy", hooks_source(register_kv_tiers=f'register("torchy", "{tier}:Tier")'))


def run_engine_plugins(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(["plugins", *args])
    out, err = capsys.readouterr()
    return rc, out, err


# -------------------------------------------------------------------------
# no torch on the light paths
# -------------------------------------------------------------------------

NO_TORCH_STEPS = {
    "import engine": "import engine\nengine.hookimpl\nengine.__version__",
    "get_plugin_manager": "import engine\nengine.get_plugin_manager().components()",
    "engine --help": (
        "from engine.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit as exc:\n    assert exc.code == 0, exc.code"
    ),
    "engine": "from engine.cli import main\nassert main([]) == 0",
    "engine plugins": "from engine.cli import main\nassert main(['plugins']) == 0",
    "engine plugins --json": "from engine.cli import main\nassert main(['plugins', '--json']) == 0",
}


@pytest.mark.parametrize("step", list(NO_TORCH_STEPS))
def test_light_entry_points_import_no_torch(factory, step):
    plugin = torch_tier_plugin(factory)
    script = (
        "import sys\n"
        + NO_TORCH_STEPS[step]
        + "\nheavy = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))"
        + "\nassert not heavy, heavy[:5]\n"
    )

    result = subprocess.run(
        [sys.executable, "-c", script], env=factory.env(), capture_output=True, text=True, timeout=60
    )

    assert result.returncode == 0, result.stderr
    if step == "engine --help":
        assert "plugins" in result.stdout and "generate" in result.stdout
    if step.startswith("engine plugins"):
        assert plugin in result.stdout and "cpu" in result.stdout


def test_engine_command_imports_no_torch(factory):
    """The installed console script itself, with Python's import log as the witness."""
    script = Path(sys.executable).parent / "engine"
    if not script.exists():
        pytest.skip(f"no engine console script next to {sys.executable}")
    plugin = torch_tier_plugin(factory)
    env = factory.env() | {"PYTHONPROFILEIMPORTTIME": "1"}

    for argv in (["--help"], ["plugins", "--json"]):
        result = subprocess.run([str(script), *argv], env=env, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        imported = re.findall(r"^import time:.*\|\s*(\S+)\s*$", result.stderr, flags=re.MULTILINE)
        assert "engine.cli" in imported  # the import log was captured
        assert not [m for m in imported if m == "torch" or m.startswith("torch.")], argv
    tiers = json.loads(result.stdout)["components"]["kv_tiers"]
    assert ("torchy", plugin) in [(t["name"], t["plugin"]) for t in tiers]


# -------------------------------------------------------------------------
# engine plugins
# -------------------------------------------------------------------------


def test_plugins_json_lists_the_installed_plugins_and_their_components(capsys):
    rc, out, _ = run_engine_plugins(capsys, "--json")

    assert rc == 0
    report = json.loads(out)
    assert (report["engine"], report["plugin_api"]) == (engine.__version__, PLUGIN_API_VERSION)
    plugins = {p["name"]: p for p in report["plugins"]}
    assert set(REAL_PLUGINS) <= set(plugins)
    for name, dist in REAL_PLUGINS.items():
        p = plugins[name]
        assert (p["distribution"], p["version"], p["source"]) == (dist, md.version(dist), "entry_point")
        assert p["loaded"] is True and p["error"] is None

    cpu, llama = plugins["cpu"], plugins["llama"]
    assert cpu["hooks"] == ["register_attention_backends", "register_platforms"]
    assert cpu["components"] == {
        "platforms": ["cpu"],
        "attention_backends": ["cpu_indexer", "cpu_kda", "cpu_mamba2", "cpu_mla", "cpu_paged"],
    }
    assert llama["hooks"] == ["register_models", "register_reasoning_parsers", "register_tool_parsers"]
    assert llama["components"] == {
        "models": LLAMA_ARCHITECTURES,
        "tool_parsers": ["hermes", "llama3_json", "mistral"],
        "reasoning_parsers": ["qwen3"],
    }

    components = report["components"]
    assert set(components) == {
        "platforms",
        "models",
        "attention_backends",
        "quantizers",
        "spec_proposers",
        "kv_tiers",
        "structured_output_backends",
        "tool_parsers",
        "reasoning_parsers",
    }
    assert {
        "name": "cpu",
        "target": "engine_cpu.platform:CpuPlatform",
        "plugin": "cpu",
        "distribution": f"engine-cpu {md.version('engine-cpu')}",
    } in components["platforms"]
    models = {entry["name"]: entry for entry in components["models"]}
    assert models["LlamaForCausalLM"]["target"] == "engine_llama.model:LlamaForCausalLM"


def test_plugins_text_lists_plugins_hooks_and_components(capsys):
    rc, out, _ = run_engine_plugins(capsys, "--plugins", "cpu")

    assert rc == 0
    assert out.splitlines() == [
        f"cpu  (engine-cpu {md.version('engine-cpu')}, entry_point) loaded",
        "  hooks: register_attention_backends, register_platforms",
        "  platforms: cpu",
        "  attention_backends: cpu_indexer, cpu_kda, cpu_mamba2, cpu_mla, cpu_paged",
        "built into the engine:",
        "  attention_backends: triton_kda, triton_mamba2, triton_mla, triton_paged",
        "  spec_proposers: draft, mtp, ngram",
        "  kv_tiers: cpu",
    ]


def test_plugins_probe_reports_the_cpu_platform_available(capsys):
    rc, out, _ = run_engine_plugins(capsys, "--plugins", "cpu", "--probe")
    assert rc == 0
    assert re.search(r"^platform cpu: available \(.+\)$", out, flags=re.MULTILINE), out

    rc, out, _ = run_engine_plugins(capsys, "--plugins", "cpu", "--probe", "--json")
    assert rc == 0
    (probe,) = json.loads(out)["platforms"]
    assert (probe["name"], probe["available"]) == ("cpu", True)


def test_plugins_probe_reports_unavailable_and_failing_platforms(factory, capsys):
    module = factory.module(
        factory.name("probeplat"),
        """
        from engine.interfaces.platform import Availability, MemoryInfo, Platform

        class Base(Platform):
            device_type = "fake"
            dist_backend = "gloo"
            supported_dtypes = ("float32",)

            def memory_info(self):
                return MemoryInfo(1, 1)

        class Absent(Base):
            name = "absent"

            @classmethod
            def is_available(cls):
                return Availability(False, "no fake device found")

        class Crashing(Base):
            name = "crashing"

            @classmethod
            def is_available(cls):
                raise RuntimeError("driver exploded")
    """,
    )
    plugin = factory.plugin(
        "probeplug",
        hooks_source(
            register_platforms=f"""
        register("absent", "{module}:Absent")
        register("crashing", "{module}:Crashing")
    """
        ),
    )

    rc, out, _ = run_engine_plugins(capsys, "--plugins", plugin, "--probe")

    assert rc == 0
    assert "platform absent: not available (no fake device found)" in out
    assert "platform crashing: not available (probe failed: RuntimeError: driver exploded)" in out


def test_plugins_lists_a_broken_autoloaded_plugin_as_failed(factory, capsys):
    broken = factory.plugin("broken", 'raise ImportError("needs libfoo")\n', dist="broken-dist", version="0.9")

    rc, out, _ = run_engine_plugins(capsys)

    assert rc == 0
    lines = out.splitlines()
    index = lines.index(f"{broken}  (broken-dist 0.9, entry_point) FAILED")
    assert lines[index + 1].startswith("  error: import of ") and "ImportError: needs libfoo" in lines[index + 1]
    assert "cpu  (engine-cpu" in out and "  platforms: cpu" in out

    rc, out, _ = run_engine_plugins(capsys, "--json")
    plugins = {p["name"]: p for p in json.loads(out)["plugins"]}
    assert plugins[broken]["loaded"] is False and "needs libfoo" in plugins[broken]["error"]
    assert plugins["cpu"]["loaded"] is True


def test_plugins_runs_through_duplicates_and_shows_what_each_plugin_replaced_or_lost(factory, capsys):
    first = factory.plugin("first", hooks_source(register_kv_tiers='register("dup", "a.b:D")'), dist="first-dist")
    second = factory.plugin("second", hooks_source(register_kv_tiers='register("dup", "a.b:E")'), dist="second-dist")
    swap = factory.plugin(
        "swap", hooks_source(register_kv_tiers='register("cpu", "a.b:C", override=True)'), dist="swap-dist"
    )

    rc, out, _ = run_engine_plugins(capsys)

    assert rc == 0
    lines = out.splitlines()
    reason = (
        f"The KV tier 'dup' is registered by two plugins, {first!r} (first-dist 1.0) and {second!r} "
        "(second-dist 1.0), so neither is used. Uninstall one of them, or name the one to use with --plugins."
    )
    for name, dist in ((first, "first-dist"), (second, "second-dist")):
        index = lines.index(f"{name}  ({dist} 1.0, entry_point) loaded with problems")
        assert lines[index + 1] == f"  skipped: {reason}"
    index = lines.index(f"{swap}  (swap-dist 1.0, entry_point) loaded")
    assert lines[index + 2] == "  kv_tiers: cpu (replaces the engine's built-in)"
    assert f"  kv_tiers: cpu (replaced by plugin {swap!r})" in lines
    assert "cpu  (engine-cpu" in out and "  platforms: cpu" in out

    rc, out, _ = run_engine_plugins(capsys, "--json")
    plugins = {p["name"]: p for p in json.loads(out)["plugins"]}
    assert plugins[first]["problems"] == [reason] and plugins[first]["loaded"] is True
    assert plugins[swap]["replaced"] == {
        "kv_tiers": [{"name": "cpu", "plugin": "engine", "target": "engine.kv_tiers.cpu:CpuKVTier"}]
    }


def test_plugins_with_an_unknown_selection_fails_with_one_line(capsys):
    rc, out, err = run_engine_plugins(capsys, "--plugins", "nosuchplugin")

    assert rc == 1 and out == ""
    assert err.startswith("engine plugins: error: Unknown plugin 'nosuchplugin'. Installed plugins: ")
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("how", ["option", "env"])
def test_plugins_with_an_empty_selection_loads_none(capsys, monkeypatch, how):
    if how == "env":
        monkeypatch.setenv("ENGINE_PLUGINS", "")
        rc, out, _ = run_engine_plugins(capsys, "--json")
    else:
        rc, out, _ = run_engine_plugins(capsys, "--plugins", "", "--json")

    assert rc == 0
    report = json.loads(out)
    assert report["plugins"] == []
    # only what the engine itself provides: the Triton backends, the cpu KV tier, the ngram and draft proposers
    assert {kind: [e["name"] for e in entries] for kind, entries in report["components"].items() if entries} == {
        "attention_backends": ["triton_kda", "triton_mamba2", "triton_mla", "triton_paged"],
        "kv_tiers": ["cpu"],
        "spec_proposers": ["draft", "mtp", "ngram"],
    }
    assert report["components"]["kv_tiers"][0]["plugin"] == "engine"

    rc, out, _ = run_engine_plugins(capsys, "--plugins", "")
    assert out == (
        "No plugins loaded.\nbuilt into the engine:\n  attention_backends: triton_kda, triton_mamba2, triton_mla, triton_paged\n"
        "  spec_proposers: draft, mtp, ngram\n  kv_tiers: cpu\n"
    )
