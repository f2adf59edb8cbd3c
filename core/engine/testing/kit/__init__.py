"""The plugin conformance kit: one base test class per component kind.

A plugin's own ``tests/`` subclasses the class for its component, names the
component (a class attribute) and the plugin that provides it, and pytest runs
every check against a reference oracle::

    from engine.testing.kit import AttentionBackendTests

    class TestMyBackend(AttentionBackendTests):
        plugin = "my_plugin"            # entry-point name or module path
        backend_name = "my_backend"     # the name it registers

Checks for capabilities the component does not declare are skipped with the
missing capability as the reason (listed again in pytest's summary); known
failures go in ``expected_failures = {"test_name": "reason"}`` and run as strict
xfails.
"""

from __future__ import annotations

import importlib
from typing import Any

from engine.testing.kit.base import KitTests, capability_skip

_CLASSES = {
    "AttentionBackendTests": "engine.testing.kit.attention",
    "ModelTests": "engine.testing.kit.model",
    "PlatformTests": "engine.testing.kit.platform",
    "KVTierTests": "engine.testing.kit.kv_tier",
    "QuantizerTests": "engine.testing.kit.quantizer",
    "SpecProposerTests": "engine.testing.kit.spec_proposer",
    "StructuredOutputBackendTests": "engine.testing.kit.structured_output",
    "ToolParserTests": "engine.testing.kit.parsers",
    "ReasoningParserTests": "engine.testing.kit.parsers",
    "ToolCase": "engine.testing.kit.parsers",
    "ReasoningCase": "engine.testing.kit.parsers",
}

__all__ = ["KitTests", "capability_skip", *_CLASSES]


def __getattr__(name: str) -> Any:
    # each kind's module is imported when its class is asked for (the pytest plugin only needs base)
    if name in _CLASSES:
        return getattr(importlib.import_module(_CLASSES[name]), name)
    raise AttributeError(f"module 'engine.testing.kit' has no attribute {name!r}")
