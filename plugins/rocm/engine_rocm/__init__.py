"""engine-rocm: the AMD GPU platform (ROCm/HIP through torch's ``cuda`` device type)."""
