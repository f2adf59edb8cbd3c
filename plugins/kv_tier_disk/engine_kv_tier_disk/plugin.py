"""Hook implementations of engine-kv-tier-disk. Imports nothing heavy."""

import engine


@engine.hookimpl
def register_kv_tiers(register):
    register("disk", "engine_kv_tier_disk.tier:DiskKVTier")
