"""engine-llama: Llama / Mistral / Qwen2 / Qwen3 for engine."""
