"""PLUGINS.md's model tutorial, followed verbatim: its files are written as shown, the model
passes the conformance kit against transformers, and its commands make a checkpoint of the
architecture and run the engine on it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))
from test_plugins_tutorial import ROOT, run_kit_of, section_files  # noqa: E402

TITLE = "Tutorial: a model architecture"
FILES = {
    "engine-mymodel/pyproject.toml",
    "engine-mymodel/engine_mymodel/plugin.py",
    "engine-mymodel/engine_mymodel/model.py",
    "engine-mymodel/tests/test_kit.py",
}


def commands() -> str:
    """The section's ``bash`` block."""
    text = (ROOT / "PLUGINS.md").read_text(encoding="utf-8")
    start = text.index(f"## {TITLE}")
    section = text[start : text.index("\n## ", start + 1)]
    found = re.findall(r"```bash\n(.*?)```", section, flags=re.DOTALL)
    assert len(found) == 1, f"the section has {len(found)} bash blocks, not one"
    return found[0]


def test_model_tutorial_model_passes_the_kit(tmp_path):
    files = section_files(TITLE, "engine-mymodel")
    assert set(files) == FILES
    output = run_kit_of(tmp_path, files, "engine-mymodel", "engine_mymodel", "mymodel")
    assert "6 passed, 1 skipped" in output, output[-2000:]
    assert "capability not declared: tensor parallelism" in output


def test_model_tutorial_commands_serve_a_checkpoint_of_the_architecture(tmp_path):
    files = section_files(TITLE, "engine-mymodel")
    for relative, content in files.items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content, encoding="utf-8")
    (tmp_path / "engine-mymodel/engine_mymodel/__init__.py").write_text("", encoding="utf-8")
    script = commands()
    assert script.count("--plugins cpu,mymodel ") == 2
    # the plugin as if installed: named by its module path instead of its entry point
    script = script.replace("--plugins cpu,mymodel ", "--plugins cpu,engine_mymodel.plugin ")
    env = {k: v for k, v in os.environ.items() if k not in ("ENGINE_PLUGINS", "ENGINE_TRACE_PLUGINS")}
    env.update(
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        PYTHONPATH=str(tmp_path / "engine-mymodel"),
        HF_HUB_OFFLINE="1",
    )
    result = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("(GemmaForCausalLM) on cpu") == 2, result.stdout
    assert result.stdout.count("(finish: length)") == 2, result.stdout
