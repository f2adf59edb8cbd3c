"""Devices the faked CUDA probes of these tests report: (name, compute capability)."""

CUDA_VERSION = "12.8"

H100 = ("NVIDIA H100 80GB HBM3", (9, 0))
L4 = ("NVIDIA L4", (8, 9))
A100 = ("NVIDIA A100-SXM4-80GB", (8, 0))
T4 = ("Tesla T4", (7, 5))
V100 = ("Tesla V100-SXM2-16GB", (7, 0))
B200 = ("NVIDIA B200", (10, 0))
