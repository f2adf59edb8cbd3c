"""engine-bitsandbytes: bitsandbytes NF4 / FP4 / LLM.int8 quantization for engine."""
