"""PLUGINS.md's quantization tutorial, followed verbatim: its files are written as shown, the
quantizer passes the conformance kit, and the command it prints quantizes the demo model."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))
from test_plugins_tutorial import ROOT, run_kit_of, section_files  # noqa: E402

TITLE = "Tutorial: a quantization method"
FILES = {
    "engine-myquant/pyproject.toml",
    "engine-myquant/engine_myquant/plugin.py",
    "engine-myquant/engine_myquant/quantizer.py",
    "engine-myquant/tests/test_kit.py",
}


def test_quantizer_tutorial_quantizer_passes_the_kit(tmp_path):
    files = section_files(TITLE, "engine-myquant")
    assert set(files) == FILES
    output = run_kit_of(tmp_path, files, "engine-myquant", "engine_myquant", "myquant")
    # export_weight: its check runs; no experts method: only that check is skipped
    assert "8 passed, 1 skipped" in output and "capability not declared: get_experts_method" in output, output[-2000:]


def test_quantizer_tutorial_command_quantizes_the_demo_model(tmp_path):
    files = section_files(TITLE, "engine-myquant")
    for relative, content in files.items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content, encoding="utf-8")
    (tmp_path / "engine-myquant/engine_myquant/__init__.py").write_text("", encoding="utf-8")
    text = (ROOT / "PLUGINS.md").read_text(encoding="utf-8")
    section = text[text.index(f"## {TITLE}") :]
    command = re.search(r"^engine .*--quantization my_int8.*$", section, re.MULTILINE).group(0)
    # the plugin is not pip-installed here: named by its module path
    argv = shlex.split(command.replace(",myquant ", ",engine_myquant.plugin "))
    argv = [sys.executable, "-m", "engine", *argv[1:], "--max-tokens", "4"]
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "engine-myquant"), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    # the demo Llama: 4 layers of qkv, o, gate_up and down; its lm_head is tied to the embedding
    assert "quantization my_int8: 16 linear layers quantized, 1 left as they are (lm_head)" in output, output[-3000:]
    assert re.search(r"output ids: \[\d+", output), output[-3000:]
