"""engine-cpu's fused layer ops: the native kernels behind engine.interfaces.ops.LayerOps."""

from __future__ import annotations

import os
from types import ModuleType
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine.interfaces.ops import LayerOps

if TYPE_CHECKING:
    from engine.interfaces.group_quant import GroupQuantWeight

NATIVE_DTYPES = (torch.float32, torch.bfloat16)
FP8_DECODE_ROWS = 8  # rows of x up to which fp8_linear runs the kernel (it reads the weight once)
FP8_TILE_ROWS = 1024  # output rows dequantized at a time for more rows


class NativeLayerOps(LayerOps):
    """One kernel call per op; other dtypes and layouts fall back to the reference."""

    def __init__(self, kernels: ModuleType, *, int8_activations: bool | None = None) -> None:
        """``int8_activations``: bf16 decode rows of group-quantized layers may be quantized to
        int8 where the kernels have AVX512-VNNI (``group_quant_linear``); None reads
        ``ENGINE_CPU_INT8_ACTIVATIONS`` (on unless it is 0)."""
        self.kernels = kernels
        if int8_activations is None:
            int8_activations = os.environ.get("ENGINE_CPU_INT8_ACTIVATIONS", "1").strip().lower() not in (
                "0",
                "false",
                "off",
            )
        self.int8_activations = int8_activations

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype not in NATIVE_DTYPES or x.stride(-1) != 1:
            return super().rms_norm(x, weight, eps)
        rows = x.reshape(-1, x.shape[-1])
        out = torch.empty(rows.shape, dtype=x.dtype)
        self.kernels.rms_norm(out, rows, weight, eps)
        return out.view(x.shape)

    def add_rms_norm(self, x, residual, weight, eps):
        if x.dtype not in NATIVE_DTYPES or not (x.is_contiguous() and residual.is_contiguous()):
            return super().add_rms_norm(x, residual, weight, eps)
        self.kernels.add_rms_norm(x, residual, weight, eps)
        return x, residual

    def rotary(self, q, k, cos, sin):
        if q.dtype not in NATIVE_DTYPES or q.stride(-1) != 1 or k.stride(-1) != 1:
            return super().rotary(q, k, cos, sin)
        self.kernels.rotary(q, k, cos.contiguous(), sin.contiguous())
        return q, k

    def silu_and_mul(self, x):
        if x.dtype not in NATIVE_DTYPES or not x.is_contiguous():
            return super().silu_and_mul(x)
        out = torch.empty(*x.shape[:-1], x.shape[-1] // 2, dtype=x.dtype)
        self.kernels.silu_and_mul(out, x)
        return out

    def apply_token_bitmask(self, logits, bitmask, rows):
        if logits.dtype not in NATIVE_DTYPES or logits.dim() != 2 or not logits.is_contiguous():
            return super().apply_token_bitmask(logits, bitmask, rows)
        self.kernels.apply_token_bitmask(logits, bitmask.contiguous(), rows.contiguous())

    def argmax(self, logits):
        if logits.dtype not in NATIVE_DTYPES or logits.dim() != 2 or not logits.is_contiguous() or logits.shape[1] == 0:
            return super().argmax(logits)
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        self.kernels.argmax(out, logits)
        return out

    def fp8_linear(self, x, weight, scales, block_k, bias=None):
        # decode rows: the kernel reads the e4m3 bytes once for all of them; more rows (prefill):
        # tiles of output rows dequantized to x's dtype, times the BLAS (oneDNN, AMX where there is one)
        if x.dtype not in NATIVE_DTYPES or not x.is_cpu or weight.dtype != torch.float8_e4m3fn:
            return super().fp8_linear(x, weight, scales, block_k, bias)
        n, k = weight.shape
        rows = x if x.dim() == 2 else x.reshape(-1, k)
        if not rows.is_contiguous():
            rows = rows.contiguous()
        if scales.dtype != torch.float32 or not scales.is_contiguous():
            scales = scales.float().contiguous()
        if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
            bias = bias.float().contiguous()
        if rows.shape[0] <= FP8_DECODE_ROWS:
            out = self.kernels.fp8_matmul(rows, weight, scales, block_k, bias)
        else:
            out = torch.empty(rows.shape[0], n, dtype=x.dtype)
            for n0 in range(0, n, FP8_TILE_ROWS):
                n1 = min(n, n0 + FP8_TILE_ROWS)
                tile = torch.empty(n1 - n0, k, dtype=x.dtype)
                self.kernels.fp8_dequantize(tile, weight[n0:n1], scales[n0:n1], block_k)
                product = F.linear(rows, tile)
                out[:, n0:n1] = product if bias is None else product.float() + bias[n0:n1]
        return out if rows is x else out.view(*x.shape[:-1], n)

    def group_quant_linear(
        self, x: torch.Tensor, weight: GroupQuantWeight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        # a decode step calls this for every quantized layer: no work beyond the kernel's checks
        # (the layout's tensors are contiguous by construction; the kernel refuses any that is
        # not, or a weight off the CPU), and the output made by the kernel
        if x.dtype not in NATIVE_DTYPES or not x.is_cpu:
            return super().group_quant_linear(x, weight, bias)
        if weight.input_order is not None:
            x = x.index_select(-1, weight.input_order)
        rows = x if x.dim() == 2 else x.reshape(-1, weight.in_features)
        if not rows.is_contiguous():
            rows = rows.contiguous()
        if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
            bias = bias.float().contiguous()
        out = self.kernels.group_quant_matmul(
            rows,
            weight.qweight,
            weight.scales,
            weight.offsets,
            weight.super_scales,
            weight.super_offsets,
            weight.bits,
            weight.group_size,
            weight.super_group,
            -1 if weight.zero is None else weight.zero,
            bias,
            self.int8_activations,
        )
        return out if rows is x else out.view(*x.shape[:-1], weight.out_features)
