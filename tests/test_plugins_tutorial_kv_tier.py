"""PLUGINS.md's KV tier tutorial, followed verbatim: its files are written as shown, the
tier passes the conformance kit, and its script makes the engine store blocks into the tier
and load them back."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))
from test_plugins_tutorial import run_kit_of, section_files  # noqa: E402

TITLE = "Tutorial: a KV tier"
FILES = {
    "engine-mytier/pyproject.toml",
    "engine-mytier/engine_mytier/plugin.py",
    "engine-mytier/engine_mytier/tier.py",
    "engine-mytier/tests/test_kit.py",
    "engine-mytier/exercise.py",
}


def test_kv_tier_tutorial_tier_passes_the_kit(tmp_path):
    files = section_files(TITLE, "engine-mytier")
    assert set(files) == FILES
    output = run_kit_of(tmp_path, files, "engine-mytier", "engine_mytier", "mytier")
    assert "capability not declared: eviction = 'fifo'" in output  # the one check skipped
    assert "14 passed" in output, output[-2000:]


def test_kv_tier_tutorial_script_makes_the_engine_store_and_load(tmp_path):
    files = section_files(TITLE, "engine-mytier")
    for relative, content in files.items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content, encoding="utf-8")
    (tmp_path / "engine-mytier/engine_mytier/__init__.py").write_text("", encoding="utf-8")
    blocks = tmp_path / "blocks"
    script = files["engine-mytier/exercise.py"]
    assert '"/tmp/engine-mytier"' in script
    (tmp_path / "exercise.py").write_text(script.replace('"/tmp/engine-mytier"', repr(str(blocks))), encoding="utf-8")
    # the plugin as if installed: loaded by its module path beside the platform and model plugins
    env = {
        **os.environ,
        "PYTHONPATH": str(tmp_path / "engine-mytier"),
        "ENGINE_PLUGINS": "cpu,llama,engine_mytier.plugin",
        "HF_HUB_OFFLINE": "1",
    }
    result = subprocess.run(
        [sys.executable, "exercise.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    counters = {name: int(value) for name, value in re.findall(r"(\w+)=(\d+),", result.stdout)}
    assert counters["stored_blocks"] > 0 and counters["store_failures"] == 0, counters
    assert counters["hits"] > 0 and counters["loaded_blocks"] > 0 and counters["load_failures"] == 0, counters
    # the blocks are files in the tier's directory (one per spec digest), and outlive the engine
    (digest,) = blocks.iterdir()
    assert len(list(digest.iterdir())) >= counters["loaded_blocks"]
