"""PLUGINS.md's speculative proposer tutorial, followed verbatim: its files are written as
shown and the proposer passes the conformance kit (nothing skipped)."""

from __future__ import annotations

import sys
from pathlib import Path

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))
from test_plugins_tutorial import run_kit_of, section_files  # noqa: E402

TITLE = "Tutorial: a speculative proposer"
FILES = {
    "engine-myproposer/pyproject.toml",
    "engine-myproposer/engine_myproposer/plugin.py",
    "engine-myproposer/engine_myproposer/bigram.py",
    "engine-myproposer/tests/test_kit.py",
}


def test_proposer_tutorial_proposer_passes_the_kit(tmp_path):
    files = section_files(TITLE, "engine-myproposer")
    assert set(files) == FILES
    output = run_kit_of(tmp_path, files, "engine-myproposer", "engine_myproposer", "myproposer")
    # deterministic and rollback-safe: the order and rollback checks run rather than skip
    assert "7 passed" in output and "skipped" not in output, output[-2000:]
