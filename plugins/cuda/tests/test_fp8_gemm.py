"""The block-scaled FP8 GEMM (engine_cuda.fp8_gemm) under the Triton interpreter, against
the dequantized product written plainly: ``x · (W · S)ᵀ`` in float64, with ``S`` expanded
block by block, and the activation quantizer against what e4m3 can hold."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined: run them on the CPU

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from engine_cuda.fp8_gemm import E4M3_MAX, fp8_block_linear, quantize_fp8_groups  # noqa: E402


def expand(scales: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    """One factor per block -> one per element of a ``shape`` matrix."""
    rows, cols = shape
    full = scales.reshape(-(-rows // block[0]), -(-cols // block[1])).double()
    return full.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]


def fp8_weight(n: int, k: int, block: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An e4m3 weight [n, k] and float32 factors per block that differ by up to e^±3 (a
    factor applied to the wrong block shows)."""
    gen = torch.Generator().manual_seed(seed)
    elements = (torch.randn(n, k, generator=gen) * 64).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    scales = torch.exp(1.5 * torch.randn(-(-n // block[0]), -(-k // block[1]), generator=gen)) / 64
    return elements, scales


def dequantized_product(x, elements, scales, block, bias):
    weight = elements.double() * expand(scales, block, tuple(elements.shape))
    return x.double() @ weight.T + (0 if bias is None else bias.double())


def relative_error(y: torch.Tensor, expected: torch.Tensor) -> float:
    return (y.double() - expected).abs().max().item() / expected.abs().max().item()


# (M, N, K, weight block, block_m, block_n, block_k): DeepSeek's 128 x 128 blocks with a
# partial last block both ways, several K tiles a block, per-channel and per-tensor scales,
# a decode row, M past a tile edge
CASES = [
    (5, 200, 256, (128, 128), 16, 64, 64),
    (1, 130, 384, (128, 128), None, 64, 128),
    (37, 64, 160, (32, 32), 16, 32, 32),
    (9, 48, 96, (1, 96), 16, 16, 32),
    (3, 40, 72, (40, 72), 16, 16, 32),
]


@pytest.mark.parametrize("m, n, k, block, block_m, block_n, block_k", CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_w8a16_matches_the_dequantized_product(m, n, k, block, block_m, block_n, block_k, bias):
    """Activations kept in float32: the kernel computes x · (W · S)ᵀ (+ b) itself."""
    gen = torch.Generator().manual_seed(m + n + k)
    elements, scales = fp8_weight(n, k, block, seed=n * k)
    x = torch.randn(m, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    y = fp8_block_linear(
        x, elements, scales, block, b, quantize_activations=False, block_m=block_m, block_n=block_n, block_k=block_k
    )
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert relative_error(y, dequantized_product(x, elements, scales, block, b)) <= 1e-5


@pytest.mark.parametrize("m, n, k, block, block_m, block_n, block_k", CASES)
def test_w8a8_matches_the_product_of_both_dequantized_operands(m, n, k, block, block_m, block_n, block_k):
    """Activations quantized per row and K group: the kernel's result is the product of the
    two dequantized operands, and within FP8's rounding of the unquantized product."""
    gen = torch.Generator().manual_seed(7 * m + k)
    elements, scales = fp8_weight(n, k, block, seed=n + k)
    x = torch.randn(m, k, generator=gen) * torch.exp(torch.randn(1, k, generator=gen))  # uneven channels
    y = fp8_block_linear(x, elements, scales, block, block_m=block_m, block_n=block_n, block_k=block_k)
    group = block[1] if block[1] < k else k
    q, x_scales = quantize_fp8_groups(x, group)
    x_dequantized = q.double() * expand(x_scales, (1, group), (m, k))
    assert relative_error(y, dequantized_product(x_dequantized, elements, scales, block, None)) <= 1e-5
    assert relative_error(y, dequantized_product(x, elements, scales, block, None)) <= 0.08


def test_bfloat16_activations_give_bfloat16_outputs_within_its_rounding():
    gen = torch.Generator().manual_seed(3)
    elements, scales = fp8_weight(96, 256, (128, 128), seed=11)
    x = torch.randn(4, 256, generator=gen).to(torch.bfloat16)
    for quantize in (False, True):
        y = fp8_block_linear(x, elements, scales, (128, 128), quantize_activations=quantize)
        assert y.dtype == torch.bfloat16
        x_ref = x.float()
        if quantize:
            q, s = quantize_fp8_groups(x_ref, 128)
            x_ref = q.double() * expand(s, (1, 128), (4, 256))
        assert relative_error(y, dequantized_product(x_ref, elements, scales, (128, 128), None)) <= 1e-2


def test_leading_dims_are_kept_and_empty_batches_work():
    elements, scales = fp8_weight(32, 64, (32, 32), seed=1)
    x = torch.randn(2, 3, 64)
    y = fp8_block_linear(x, elements, scales, (32, 32), block_k=32)
    assert y.shape == (2, 3, 32)
    expected = fp8_block_linear(x.reshape(6, 64), elements, scales, (32, 32), block_k=32)
    torch.testing.assert_close(y.reshape(6, 32), expected, rtol=0, atol=0)
    assert fp8_block_linear(torch.empty(0, 64), elements, scales, (32, 32), block_k=32).shape == (0, 32)


def test_per_channel_scales_may_come_as_a_vector_and_per_tensor_as_a_scalar():
    gen = torch.Generator().manual_seed(2)
    elements, _ = fp8_weight(24, 64, (1, 64), seed=5)
    x = torch.randn(3, 64, generator=gen)
    channel = torch.rand(24, generator=gen) + 0.5
    y = fp8_block_linear(x, elements, channel, (1, 64), quantize_activations=False, block_n=16, block_k=32)
    expected = x.double() @ (elements.double() * channel.double()[:, None]).T
    assert relative_error(y, expected) <= 1e-5
    y = fp8_block_linear(x, elements, torch.tensor(0.25), (24, 64), quantize_activations=False, block_n=16, block_k=32)
    assert relative_error(y, x.double() @ (elements.double() * 0.25).T) <= 1e-5


def test_quantized_groups_hold_the_values_within_e4m3_rounding():
    """Each group's largest magnitude becomes 448; every value is kept within e4m3's half
    unit in the last place (3 mantissa bits: 2^-4 relative), or its subnormal spacing."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(6, 100, generator=gen) * torch.exp(2 * torch.randn(6, 1, generator=gen))
    x[2, 40:80] = 0.0  # an all-zero group
    q, scales = quantize_fp8_groups(x, 40)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and scales.shape == (6, 3)
    restored = q.double() * expand(scales, (1, 40), (6, 100))
    bound = x.double().abs() * 2**-4 + expand(scales, (1, 40), (6, 100)) * 2**-10
    assert bool(((restored - x.double()).abs() <= bound).all())
    for r in range(6):
        for g in range(3):
            part = q[r, 40 * g : 40 * (g + 1)].float().abs()
            if x[r, 40 * g : 40 * (g + 1)].abs().max() > 0:
                assert part.max().item() == E4M3_MAX
    assert bool((q[2, 40:80].float() == 0).all())


def test_bad_shapes_are_refused_with_the_reason():
    elements, scales = fp8_weight(32, 256, (128, 128), seed=0)
    with pytest.raises(ValueError, match=r"needs \(1, 2\) scales"):
        fp8_block_linear(torch.randn(2, 256), elements, torch.ones(2, 2), (128, 128))
    with pytest.raises(ValueError, match="x has 128 features"):
        fp8_block_linear(torch.randn(2, 128), elements, scales, (128, 128))
    with pytest.raises(ValueError, match="must divide the weight's scale block"):
        fp8_block_linear(torch.randn(2, 256), elements, scales, (128, 128), block_k=96)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_block_linear(torch.randn(2, 256), elements.float(), scales, (128, 128))
