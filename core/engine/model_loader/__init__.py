"""Finding a checkpoint and streaming its safetensors into a model."""
