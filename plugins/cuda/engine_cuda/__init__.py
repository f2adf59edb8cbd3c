"""engine-cuda: the NVIDIA GPU platform."""
