"""PLUGINS.md's platform tutorial, followed verbatim: its files are written as shown, the
platform and its attention backend pass the conformance kit, and the engine runs a model on
the platform chosen by ``--device``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))
from test_plugins_tutorial import run_kit_of, section_files  # noqa: E402

TITLE = "Tutorial: a platform"
FILES = {
    "engine-myplatform/pyproject.toml",
    "engine-myplatform/engine_myplatform/plugin.py",
    "engine-myplatform/engine_myplatform/platform.py",
    "engine-myplatform/engine_myplatform/attention.py",
    "engine-myplatform/tests/test_kit.py",
}


def test_platform_tutorial_platform_passes_the_kit(tmp_path):
    files = section_files(TITLE, "engine-myplatform")
    assert set(files) == FILES
    output = run_kit_of(tmp_path, files, "engine-myplatform", "engine_myplatform", "myplatform")
    assert "capability not declared: memory_stats" in output  # a CPU allocator does not count its bytes
    assert "capability not declared: attention kind mla" in output  # the backend serves mha and sliding windows


def test_platform_tutorial_commands_run_a_model_on_the_platform(tmp_path):
    files = section_files(TITLE, "engine-myplatform")
    for relative, content in files.items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content, encoding="utf-8")
    (tmp_path / "engine-myplatform/engine_myplatform/__init__.py").write_text("", encoding="utf-8")
    # the plugin as if installed: named by its module path, as the tutorial's commands name it by entry point
    env = {k: v for k, v in os.environ.items() if k not in ("ENGINE_PLUGINS", "ENGINE_TRACE_PLUGINS")}
    env.update(PYTHONPATH=str(tmp_path / "engine-myplatform"), HF_HUB_OFFLINE="1", SHARED_CPU_THREADS="1")
    engine = [sys.executable, "-m", "engine.cli"]
    prose = " ".join((Path(__file__).resolve().parents[1] / "PLUGINS.md").read_text(encoding="utf-8").split())
    generate = "engine generate --plugins llama,myplatform --device shared_cpu --prompt-ids 1,2,3,4 --max-tokens 8"
    assert f"`{generate}`" in prose and "`engine plugins --plugins myplatform --probe`" in prose

    probe = subprocess.run(
        [*engine, "plugins", "--plugins", "engine_myplatform.plugin", "--probe"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert probe.returncode == 0, probe.stdout + probe.stderr
    assert "platforms: shared_cpu" in probe.stdout and "attention_backends: shared_cpu_paged" in probe.stdout
    assert "platform shared_cpu: available (" in probe.stdout and ", 1 used)" in probe.stdout, probe.stdout

    args = generate.replace("myplatform", "engine_myplatform.plugin").split()[2:]
    result = subprocess.run(
        [*engine, "generate", *args], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "(LlamaForCausalLM) on shared_cpu" in result.stdout, result.stdout
    assert "output ids: [" in result.stdout and "(finish: length)" in result.stdout
