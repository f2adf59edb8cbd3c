"""engine-gguf: GGUF checkpoints' quantized blocks (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K) computed as group-quantized weights."""
