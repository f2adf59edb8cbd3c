"""PLUGINS.md's tutorial, followed verbatim: its files are written as shown, its
commands run in a fresh virtual environment where engine is installed, and the
plugin it builds loads and passes the conformance kit."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATH_IN_PROSE = re.compile(r"`(engine-mybackend/[\w./-]+\.\w+)`")


def tutorial() -> tuple[dict[str, str], str]:
    """({relative path: content}, commands) from the tutorial section of PLUGINS.md.

    A fenced block is the file named by the first backticked ``engine-mybackend/...``
    path in the prose since the previous block; the commands are the block after
    ``<!-- tutorial-commands -->``."""
    text = (ROOT / "PLUGINS.md").read_text(encoding="utf-8")
    section = text[text.index("## Tutorial") : text.index("\n## ", text.index("## Tutorial") + 1)]
    files: dict[str, str] = {}
    commands = None
    pending: str | None = None
    commands_next = False
    lines = iter(section.splitlines())
    for line in lines:
        if line.startswith("```"):
            block = []
            for inner in lines:
                if inner.startswith("```"):
                    break
                block.append(inner)
            content = "\n".join(block) + "\n"
            if commands_next:
                commands, commands_next = content, False
            elif pending is not None:
                files[pending] = content
            pending = None
            continue
        if line.strip() == "<!-- tutorial-commands -->":
            commands_next = True
        match = PATH_IN_PROSE.search(line)
        if match and pending is None:
            pending = match.group(1)
    assert commands is not None, "PLUGINS.md's tutorial has no <!-- tutorial-commands --> block"
    return files, commands


def test_the_tutorial_names_every_file_it_shows():
    files, commands = tutorial()
    assert set(files) == {
        "engine-mybackend/pyproject.toml",
        "engine-mybackend/engine_mybackend/__init__.py",
        "engine-mybackend/engine_mybackend/plugin.py",
        "engine-mybackend/engine_mybackend/attention.py",
        "engine-mybackend/tests/test_kit.py",
    }
    assert "pip install -e ./engine-mybackend" in commands
    assert "--attention-backend my_backend" in commands


@pytest.mark.slow
def test_following_the_tutorial_verbatim_gives_a_working_plugin(tmp_path):
    files, commands = tutorial()
    for relative, content in files.items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content, encoding="utf-8")

    # a fresh venv "where engine is installed": engine itself installed into it (editable, from
    # this checkout, without dependencies), its dependencies (torch, transformers, ...) seen from
    # this environment so that nothing large is downloaded
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    Path(purelib, "parent_env.pth").write_text(f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "-e", str(ROOT)], check=True, capture_output=True
    )

    env = {
        **os.environ,
        "PATH": f"{venv / 'bin'}:{os.environ['PATH']}",
        "VIRTUAL_ENV": str(venv),
        "HF_HUB_OFFLINE": "1",
    }
    env.pop("ENGINE_PLUGINS", None)
    result = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", commands], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "mybackend  (engine-mybackend 0.1.0, entry_point) loaded" in output
    assert "attention_backends: my_backend" in output
    assert re.search(r"\d+ passed", output) and " failed" not in output, output
    # the engine ran a model on it: forced by --attention-backend, as its log says
    assert "attention kind mha: backend my_backend for" in output, output


def section_files(title: str, folder: str) -> dict[str, str]:
    """{relative path: content} of the tutorial section ``title``: each fenced block is the
    file named by the last backticked ``folder/...`` path in the prose before it."""
    text = (ROOT / "PLUGINS.md").read_text(encoding="utf-8")
    start = text.index(f"## {title}")
    section = text[start : text.index("\n## ", start + 1)]
    files: dict[str, str] = {}
    pending = None
    lines = iter(section.splitlines())
    for line in lines:
        if line.startswith("```"):
            block = []
            for inner in lines:
                if inner.startswith("```"):
                    break
                block.append(inner)
            if pending is not None:
                files[pending] = "\n".join(block) + "\n"
            pending = None
            continue
        found = re.findall(rf"`({re.escape(folder)}/[\w./-]+\.\w+)`", line)
        if found:
            pending = found[-1]
    return files


def run_kit_of(tmp_path: Path, files: dict[str, str], folder: str, package: str, plugin: str) -> str:
    """Write ``files``, then run the plugin's kit tests with the plugin loaded by its module
    path (it is not pip-installed here); the pytest output."""
    for relative, content in files.items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content, encoding="utf-8")
    (tmp_path / folder / package / "__init__.py").write_text("", encoding="utf-8")
    kit_test = tmp_path / folder / "tests/test_kit.py"
    kit_test.write_text(
        kit_test.read_text(encoding="utf-8").replace(f'plugin = "{plugin}"', f'plugin = "{package}.plugin"'),
        encoding="utf-8",
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path / folder), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", str(kit_test), "-q", "-p", "no:cacheprovider", "-rs"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "failed" not in result.stdout
    return result.stdout


def test_structured_output_tutorial_backend_passes_the_kit(tmp_path):
    files = section_files("Tutorial: a structured-output backend", "engine-choices")
    assert set(files) == {
        "engine-choices/pyproject.toml",
        "engine-choices/engine_choices/plugin.py",
        "engine-choices/engine_choices/backend.py",
        "engine-choices/tests/test_kit.py",
    }
    run_kit_of(tmp_path, files, "engine-choices", "engine_choices", "choices")


def test_parser_tutorial_parsers_pass_the_kit(tmp_path):
    files = section_files("Tutorial: a model family's tool-call and reasoning parsers", "engine-functags")
    assert set(files) == {
        "engine-functags/pyproject.toml",
        "engine-functags/engine_functags/plugin.py",
        "engine-functags/engine_functags/parsers.py",
        "engine-functags/tests/test_kit.py",
    }
    output = run_kit_of(tmp_path, files, "engine-functags", "engine_functags", "functags")
    assert "skipped" in output  # the tokenizer check: the tutorial gives none
