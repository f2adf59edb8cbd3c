"""engine-xpu: the Intel GPU (XPU) platform, and MXFP8 weights multiplied by a blockwise Triton GEMM."""
