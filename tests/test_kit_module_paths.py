"""Every kit accepts a component named by its ``module.path:Class`` (as the engine's options
do) where it would take a registered name, and a plugin given as a dotted module path."""

from __future__ import annotations

import pytest

from engine.testing.kit import (
    AttentionBackendTests,
    KVTierTests,
    PlatformTests,
    QuantizerTests,
    SpecProposerTests,
    StructuredOutputBackendTests,
)

CASES = [
    (AttentionBackendTests, "engine_cpu.plugin", "backend_name", "engine_cpu.attention:CpuPagedAttention"),
    (KVTierTests, "", "tier_name", "engine.kv_tiers.cpu:CpuKVTier"),
    (PlatformTests, "cpu", "platform_name", "engine_cpu.platform:CpuPlatform"),
    (QuantizerTests, "bitsandbytes", "quantizer_name", "engine_bitsandbytes.quantizer:BitsAndBytesQuantizer"),
    (SpecProposerTests, "", "proposer_name", "engine.spec_decode.ngram:NgramProposer"),
    (StructuredOutputBackendTests, "engine_xgrammar.plugin", "backend_name", "engine_xgrammar.backend:XGrammarBackend"),
]


@pytest.mark.parametrize("kit, plugin, attribute, name", CASES, ids=[case[0].__name__ for case in CASES])
def test_discoverable_by_module_path(kit, plugin, attribute, name):
    case = type("Case", (kit,), {"plugin": plugin, attribute: name})
    case().test_discoverable()


@pytest.mark.parametrize("kit, plugin, attribute, name", CASES, ids=[case[0].__name__ for case in CASES])
def test_a_module_path_to_something_else_fails(kit, plugin, attribute, name):
    module = name.partition(":")[0]
    wrong = f"{module}:__class__"  # resolves, but to the module type, not a component of the kind
    case = type("Case", (kit,), {"plugin": plugin, attribute: wrong})
    with pytest.raises((AssertionError, TypeError)):
        case().test_discoverable()
