"""engine-nemotron-h: NVIDIA's Nemotron-H hybrid Mamba-2 models for engine."""
