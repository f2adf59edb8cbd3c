"""engine-gptq: GPTQ checkpoints (4-bit and 8-bit, grouped, act-order) computed from their packed weights."""
