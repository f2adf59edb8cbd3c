"""The MXFP8 format in torch (engine_xpu.mxfp8): scale choice and E8M0 encoding against
a float64 reference, exact round trips of representable weights, and the rounding error
of random ones."""

from __future__ import annotations

import pytest
import torch

from engine_xpu.mxfp8 import (
    BLOCK,
    E4M3_MAX,
    check_mxfp8,
    e8m0_to_float,
    exp2_exact,
    mxfp8_dequantize,
    mxfp8_linear_reference,
    mxfp8_quantize,
)

E8M0 = getattr(torch, "float8_e8m0fnu", None)


def reference_exponents(weight: torch.Tensor) -> torch.Tensor:
    """Per block of 32: the smallest e in [-127, 127] with amax <= 448 · 2^e, in float64
    (exact for float32 weights: amax / 448 lands on a power of two only when it is one)."""
    rows, columns = weight.shape
    padded = torch.nn.functional.pad(weight.double().abs(), (0, -columns % BLOCK))
    amax = padded.view(rows, -1, BLOCK).amax(-1)
    return torch.ceil(torch.log2(amax / E4M3_MAX)).clamp(-127, 127).to(torch.int64)


def random_mxfp8(gen: torch.Generator, rows: int, columns: int, max_scale: int = 245):
    """Random e4m3 bytes (NaN codes excluded) and scales up to ``max_scale`` (so the weight
    stays finite in float32)."""
    codes = torch.randint(0, 256, (rows, columns), generator=gen, dtype=torch.int32)
    codes = torch.where((codes & 0x7F) == 0x7F, codes - 1, codes).to(torch.uint8)
    scales = torch.randint(0, max_scale + 1, (rows, -(-columns // BLOCK)), generator=gen, dtype=torch.int32)
    return codes.view(torch.float8_e4m3fn), scales.to(torch.uint8)


def test_exp2_exact_and_e8m0_decoding_are_exact_powers_of_two():
    exponents = torch.arange(-127, 128)
    assert exp2_exact(exponents).tolist() == [2.0**e for e in range(-127, 128)]
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    factors = e8m0_to_float(codes)
    assert factors[:255].tolist() == [2.0 ** (s - 127) for s in range(255)]
    assert torch.isnan(factors[255])
    if E8M0 is not None:  # torch's own E8M0 dtype reads the same bytes the same way
        torch.testing.assert_close(factors, codes.view(E8M0).float(), rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(e8m0_to_float(codes.view(E8M0)), factors, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("columns", [32, 256, 40])  # 40: a short last block
def test_scales_are_the_smallest_power_of_two_that_fits_the_block(columns):
    gen = torch.Generator().manual_seed(columns)
    # blocks spanning twenty orders of magnitude
    weight = torch.randn(24, columns, generator=gen) * torch.exp(torch.randn(24, 1, generator=gen) * 10)
    elements, scales = mxfp8_quantize(weight)
    assert elements.dtype == torch.float8_e4m3fn and elements.shape == (24, columns)
    assert scales.dtype == torch.uint8 and scales.shape == (24, -(-columns // BLOCK))
    assert torch.equal(scales.long() - 127, reference_exponents(weight))
    # the block's largest element, in (224, 448] before rounding, lands in [224, 448]
    scaled_amax = torch.nn.functional.pad(elements.float().abs(), (0, -columns % BLOCK)).view(24, -1, BLOCK).amax(-1)
    assert ((scaled_amax >= 224) & (scaled_amax <= 448)).all(), scaled_amax


def test_hand_computed_scales():
    blocks = torch.zeros(7, BLOCK)
    blocks[:, 0] = torch.tensor([448.0, 449.0, 224.0, 224.5, 1.0, 0.0, float("inf")])
    elements, scales = mxfp8_quantize(blocks)
    # 448 fits 2^0; 449 needs 2^1; 224 fits 2^-1; 224.5 needs 2^0; 1 -> 2^-8 (256); zeros: the smallest; inf: NaN
    assert scales[:, 0].tolist() == [127, 128, 126, 127, 119, 0, 255]
    assert elements[:, 0].float().tolist()[:6] == [448.0, 224.0, 448.0, 224.0, 256.0, 0.0]
    dense = mxfp8_dequantize(elements, scales)
    assert dense[:6, 0].tolist() == [448.0, 448.0, 224.0, 224.0, 1.0, 0.0]  # 449 rounds to 448 (e4m3: 224, 240)
    assert torch.isnan(dense[6]).all()


def test_tiny_and_huge_blocks_stay_within_the_e8m0_range():
    weight = torch.tensor([[1e-45] * BLOCK, [3e38] * BLOCK])
    elements, scales = mxfp8_quantize(weight)
    assert scales[:, 0].tolist() == [0, 127 + 120]  # 2^-127 (clamped), ceil(log2(3e38 / 448)) = 120
    dense = mxfp8_dequantize(elements, scales)
    assert dense[0].abs().max() <= 2.0**-137 and torch.isfinite(dense).all()
    torch.testing.assert_close(dense[1], weight[1], rtol=2**-4, atol=0)


@pytest.mark.parametrize("columns", [64, 40])
def test_representable_weights_round_trip_exactly(columns):
    gen = torch.Generator().manual_seed(3)
    elements, scales = random_mxfp8(gen, 16, columns)
    weight = mxfp8_dequantize(elements, scales)
    again = mxfp8_dequantize(*mxfp8_quantize(weight))
    assert torch.equal(again, weight)
    # blocks whose largest element is already 448 keep their exact bytes and scale
    codes = elements.view(torch.uint8).clone()
    codes[:, ::BLOCK] = 0x7E  # 448
    elements = codes.view(torch.float8_e4m3fn)
    requantized, rescaled = mxfp8_quantize(mxfp8_dequantize(elements, scales))
    assert torch.equal(rescaled, scales)
    assert torch.equal(requantized.view(torch.uint8), elements.view(torch.uint8))


def test_bf16_weights_round_trip_through_bf16_exactly():
    gen = torch.Generator().manual_seed(4)
    elements, scales = random_mxfp8(gen, 8, 96, max_scale=140)
    weight = mxfp8_dequantize(elements, scales, torch.bfloat16)  # e4m3 times a power of two: exact in bf16
    assert torch.equal(weight.float(), mxfp8_dequantize(elements, scales))
    assert torch.equal(mxfp8_dequantize(*mxfp8_quantize(weight), torch.bfloat16), weight)


def test_random_weights_round_to_nearest_within_e4m3_precision():
    gen = torch.Generator().manual_seed(5)
    magnitudes = torch.exp(torch.randn(128, 16, generator=gen)).repeat_interleave(32, 1)  # per block
    weight = torch.randn(128, 512, generator=gen) * magnitudes
    elements, scales = mxfp8_quantize(weight)
    dense = mxfp8_dequantize(elements, scales)
    factors = e8m0_to_float(scales).repeat_interleave(BLOCK, 1)
    # half a unit in the last place: 2^-4 relative for normal e4m3 values, 2^-10 of the factor for subnormal ones
    bound = torch.maximum(weight.abs() * 2**-4, factors * 2**-10)
    assert ((dense - weight).abs() <= bound).all()
    # Gaussian weights: about 2.7% relative error (e4m3 keeps 4 significant bits)
    gaussian = torch.randn(256, 256, generator=gen)
    error = ((mxfp8_dequantize(*mxfp8_quantize(gaussian)) - gaussian).norm() / gaussian.norm()).item()
    assert 0.02 < error < 0.03


def test_reference_linear_is_x_times_the_dequantized_weight():
    gen = torch.Generator().manual_seed(6)
    elements, scales = mxfp8_quantize(torch.randn(48, 64, generator=gen))
    x, bias = torch.randn(2, 5, 64, generator=gen), torch.randn(48, generator=gen)
    expected = (x.double() @ mxfp8_dequantize(elements, scales).double().T + bias.double()).float()
    torch.testing.assert_close(mxfp8_linear_reference(x, elements, scales, bias), expected, rtol=1e-5, atol=1e-5)
    y = mxfp8_linear_reference(x.bfloat16(), elements, scales, bias.bfloat16())
    assert y.dtype == torch.bfloat16 and y.shape == (2, 5, 48)


def test_malformed_weights_are_refused():
    elements, scales = mxfp8_quantize(torch.randn(4, 64))
    with pytest.raises(ValueError, match=r"need scales of shape \(4, 2\)"):
        check_mxfp8(elements, scales[:, :1])
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        check_mxfp8(elements.float(), scales)
    with pytest.raises(TypeError, match="uint8 or float8_e8m0fnu"):
        check_mxfp8(elements, scales.float())
    with pytest.raises(ValueError, match="2-d float weight"):
        mxfp8_quantize(torch.randn(64))
