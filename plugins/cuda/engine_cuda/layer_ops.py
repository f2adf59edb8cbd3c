"""The CUDA platform's layer ops: the engine's Triton ops (group-quantized linear layers,
``engine.kernels.group_quant``) plus FP8 linear products through engine-cuda's Triton GEMM
(``engine_cuda.fp8_gemm``), which widens the e4m3 weight tiles in the kernel and takes the
activations as they come. That is what FP8 routed experts compute with (``Fp8Weight.linear``);
FP8 linear layers choose their own kernel (``engine_cuda.fp8.Fp8LinearMethod``)."""

from __future__ import annotations

import torch

from engine.kernels.group_quant import TritonLayerOps, interpreting

FP8_GEMM_CAPABILITY = (8, 9)  # e4m3 tiles in the kernel: Ada / Hopper and later


class CudaLayerOps(TritonLayerOps):
    """:class:`TritonLayerOps` with ``fp8_linear`` on the Triton GEMM for 16-bit activations on
    a GPU of compute capability 8.9 or later (and on CPU tensors under the Triton
    interpreter); float32 activations, other GPUs and scale blocks no K tile divides take the
    reference (the dequantized product). The kernel's products of bf16 / fp16 activations and
    the weight's tiles in that dtype are what the contract allows (``LayerOps.fp8_linear``)."""

    def fp8_linear(self, x, weight, scales, block_k, bias=None):
        from engine_cuda.fp8 import k_tile

        k = weight.shape[1]
        tile = k_tile(min(block_k, k), k)
        if x.dtype not in (torch.bfloat16, torch.float16) or tile is None or not self._gemm_runs_on(x):
            return super().fp8_linear(x, weight, scales, block_k, bias)
        from engine_cuda.fp8_gemm import fp8_block_linear

        return fp8_block_linear(x, weight, scales, (1, block_k), bias, quantize_activations=False, block_k=tile)

    @staticmethod
    def _gemm_runs_on(x: torch.Tensor) -> bool:
        if x.device.type == "cpu":
            return interpreting()
        return x.device.type == "cuda" and torch.cuda.get_device_capability(x.device) >= FP8_GEMM_CAPABILITY
