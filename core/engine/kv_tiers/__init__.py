"""KV tiers that ship with the engine (registered without any plugin)."""

BUILTIN_KV_TIERS = {"cpu": "engine.kv_tiers.cpu:CpuKVTier"}
