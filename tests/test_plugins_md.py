"""PLUGINS.md documents every hook of engine.hookspecs with its exact signature, and
every hook is exercised by at least one test."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from engine import hookspecs

ROOT = Path(__file__).resolve().parents[1]


def hook_functions() -> list:
    return [
        fn
        for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
        if name.startswith("register_") and hasattr(fn, "engine_spec")
    ]


def signature_text(fn) -> str:
    """``register_models(register: RegisterCallback) -> None`` as written in the source."""
    source = inspect.getsource(fn)
    header = source[source.index("def ") + 4 : source.index(":\n")]
    return re.sub(r"\s+", " ", header).replace("( ", "(").replace(", )", ")")


def test_there_are_hooks_to_check():
    assert len(hook_functions()) == 9


@pytest.mark.parametrize("fn", hook_functions(), ids=lambda fn: fn.__name__)
def test_hook_is_documented_with_its_exact_signature(fn):
    text = (ROOT / "PLUGINS.md").read_text(encoding="utf-8")
    signature = signature_text(fn)
    assert f"`{signature}`" in text, f"PLUGINS.md lacks the signature `{signature}`"


@pytest.mark.parametrize("fn", hook_functions(), ids=lambda fn: fn.__name__)
def test_hook_is_exercised_by_a_test(fn):
    """Some test (other than this file) implements or names the hook."""
    this = Path(__file__).resolve()
    test_files = [p for p in ROOT.glob("**/test_*.py") if ".venv" not in p.parts and p.resolve() != this]
    test_files += [p for p in ROOT.glob("tests/*helpers*.py")]
    users = [p for p in test_files if fn.__name__ in p.read_text(encoding="utf-8")]
    assert users, f"no test exercises the hook {fn.__name__}"


KIT_CLASS_OF_KIND = {
    "platforms": "PlatformTests",
    "models": "ModelTests",
    "attention_backends": "AttentionBackendTests",
    "quantizers": "QuantizerTests",
    "spec_proposers": "SpecProposerTests",
    "kv_tiers": "KVTierTests",
    "structured_output_backends": "StructuredOutputBackendTests",
    "tool_parsers": "ToolParserTests",
    "reasoning_parsers": "ReasoningParserTests",
}


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_kind_has_a_tutorial_and_a_kit_class_in_the_contents():
    from engine.plugins.components import KINDS
    from engine.testing import kit

    text = (ROOT / "PLUGINS.md").read_text(encoding="utf-8")
    anchors = {github_anchor(line.lstrip("#")) for line in text.splitlines() if line.startswith("## ")}
    rows = re.findall(r"^\| [^|]+ \| \[[^\]]+\]\(#([\w-]+)\) \| (.+) \|$", text, flags=re.MULTILINE)
    assert rows, "PLUGINS.md has no contents table of tutorials"
    for anchor, classes in rows:
        assert anchor in anchors, f"the contents link #{anchor} names no section"
        assert anchor.startswith("tutorial-")
        for name in re.findall(r"`(\w+)`", classes):
            assert hasattr(kit, name), f"the contents name a kit class engine.testing.kit lacks: {name}"
    listed = {name for _, classes in rows for name in re.findall(r"`(\w+)`", classes)}
    assert {kind.attr for kind in KINDS} == set(KIT_CLASS_OF_KIND)
    missing = {kind for kind, cls in KIT_CLASS_OF_KIND.items() if cls not in listed}
    assert not missing, f"kinds without a tutorial in PLUGINS.md's contents: {sorted(missing)}"
