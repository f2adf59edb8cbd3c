"""engine-cpu's fp8_linear (LayerOps.fp8_linear: x @ (W * scale)^T + bias for e4m3 weights with a
float32 scale per output row and block of inputs) against the e4m3 format written out plainly,
on every instruction-set build this CPU runs: decode rows (the kernel that widens the bytes in
registers) and more rows (tiles dequantized for the BLAS).

Every non-NaN byte value occurs, subnormals and negative zero included, and a weight of
subnormals alone checks those at their own scale. The exact value is computed in float64. fp32
outputs may differ from it by a few float32 epsilons of the terms' size, ``|x| @ |W s|^T``; bf16
outputs by that and one rounding to bf16; with more than 8 bf16 rows the weight is rounded to
bf16 and torch's bf16 GEMM multiplies it (its sums as that GEMM does them), which may add 2^-7 of
the terms' size."""

from __future__ import annotations

import pytest
import torch

from engine.interfaces.ops import REFERENCE_OPS
from engine_cpu import native
from engine_cpu.ops import FP8_DECODE_ROWS, NativeLayerOps

N = 77  # odd: the last parallel block is partial
FP32_EPSILONS = 8.0


def e4m3(byte: int) -> float:
    """An e4m3fn byte's value: sign bit 7, exponent bits 3-6 with bias 7 (0: subnormal), mantissa
    bits 0-2; 0x7f and 0xff are NaN."""
    sign = -1.0 if byte & 0x80 else 1.0
    exponent, mantissa = (byte >> 3) & 0x0F, byte & 0x07
    if exponent == 15 and mantissa == 7:
        return float("nan")
    if exponent == 0:
        return sign * mantissa / 8 * 2.0**-6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


TABLE = torch.tensor([e4m3(b) for b in range(256)], dtype=torch.float64)
FINITE = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.uint8)


@pytest.fixture(scope="module")
def ops(each_isa):
    return NativeLayerOps(native.load())


def test_the_plain_table_is_torchs_e4m3fn():
    assert torch.equal(TABLE[FINITE.long()], FINITE.view(torch.float8_e4m3fn).double())


def random_weight(rows: int, k: int, gen: torch.Generator, codes: torch.Tensor = FINITE) -> torch.Tensor:
    picks = torch.randint(0, len(codes), (rows, k), generator=gen)
    weight = codes[picks]
    weight.view(-1)[: len(codes)] = codes[: min(len(codes), weight.numel())]  # every value at least once
    return weight


def check(ops, weight_bytes, scales, block_k, rows, dtype, bias, gen):
    k = weight_bytes.shape[1]
    x = torch.randn(rows, k, generator=gen).to(dtype)
    weight = weight_bytes.view(torch.float8_e4m3fn)
    dense = TABLE[weight_bytes.long()] * scales.double().repeat_interleave(block_k, dim=1)[:, :k]
    exact = x.double() @ dense.T + (0 if bias is None else bias.double())
    size = x.double().abs() @ dense.abs().T
    for name, got in (
        ("kernel", ops.fp8_linear(x, weight, scales, block_k, bias)),
        ("reference", REFERENCE_OPS.fp8_linear(x, weight, scales, block_k, bias)),
    ):
        assert got.shape == (rows, weight.shape[0]) and got.dtype == dtype
        allowed = FP32_EPSILONS * torch.finfo(torch.float32).eps * size + 1e-30
        if dtype == torch.bfloat16:
            allowed = allowed + exact.abs() * 2.0**-8
            if name == "kernel" and rows > FP8_DECODE_ROWS:  # bf16 weights, torch's bf16 GEMM
                allowed = allowed + size * 2.0**-7
        worst = ((got.double() - exact).abs() / allowed).max().item()
        assert worst <= 1.0, f"{name}: {worst:.2f} times the tolerance ({dtype}, {rows} rows, block {block_k})"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 5, 8, 9, 40])
@pytest.mark.parametrize(("k", "block_k"), [(384, 128), (384, 384), (200, 64), (200, 200), (56, 16)])
def test_fp8_linear_matches_the_format(ops, k, block_k, rows, dtype):
    gen = torch.Generator().manual_seed(k * 1000 + block_k + rows)
    weight = random_weight(N, k, gen)
    scales = torch.rand(N, -(-k // block_k), generator=gen) * 0.02 + 1e-4
    for bias in (None, torch.randn(N, generator=gen)):
        check(ops, weight, scales, block_k, rows, dtype, bias, gen)


@pytest.mark.parametrize("rows", [1, 4, 12])
def test_subnormal_weights_at_their_own_scale(ops, rows):
    gen = torch.Generator().manual_seed(rows)
    subnormals = torch.tensor([s | m for s in (0, 0x80) for m in range(8)], dtype=torch.uint8)
    weight = random_weight(N, 256, gen, subnormals)
    check(ops, weight, torch.full((N, 2), 3.0), 128, rows, torch.float32, None, gen)


def test_bad_shapes_are_refused(ops):
    weight = torch.zeros(8, 64, dtype=torch.uint8).view(torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match="scales float32 \\[N, ceil\\(K / block_k\\)\\]"):
        ops.fp8_linear(torch.randn(1, 64), weight, torch.ones(8, 3), 32)
