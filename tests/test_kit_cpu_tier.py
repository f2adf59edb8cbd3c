"""The built-in cpu KV tier through the conformance kit."""

from engine.testing.kit import KVTierTests


class TestCpuTierKit(KVTierTests):
    plugin = ""  # built into the engine: no plugin to load
    tier_name = "cpu"
