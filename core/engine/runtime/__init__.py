"""The engine loop: requests, KV-cache blocks, scheduling, model execution, sampling."""
