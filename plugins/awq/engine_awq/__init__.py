"""engine-awq: AutoAWQ GEMM checkpoints (4-bit, grouped) computed in the engine's group-quantized layout."""
