"""engine-compressed-tensors: compressed-tensors ``pack-quantized`` checkpoints (integer weights
packed into int32 words) computed in the engine's group-quantized layout."""
