"""engine-kimi-k3: Kimi's hybrid linear-attention models for engine."""
