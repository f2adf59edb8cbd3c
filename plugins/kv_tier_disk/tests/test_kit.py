"""The disk tier through the engine's conformance kit."""

from engine.testing.kit import KVTierTests


class TestDiskTierKit(KVTierTests):
    plugin = "kv_tier_disk"
    tier_name = "disk"

    def config(self, directory, capacity_bytes):
        return {**super().config(directory, capacity_bytes), "path": str(directory / "tier")}
