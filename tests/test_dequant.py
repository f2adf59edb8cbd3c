"""Checkpoint formats dequantized at load (engine.model_loader.dequant) against element-by-element
references: block-scaled FP8 (transformers' weight_scale_inv and the reference checkpoints' .scale,
float32 and e8m0 scales) and MXFP4-packed experts."""

from __future__ import annotations

import itertools

import pytest
import torch

from engine.model_loader.dequant import E2M1_VALUES, CheckpointDequantizer, dequantize_stream

FP8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [4, 8]}


def fp8_block_quantize(weight: torch.Tensor, block: tuple[int, int], power_of_two: bool = False):
    """(float8 weight, scales [.., ceil(rows / b0), ceil(cols / b1)]): each block over its amax / 448."""
    rows, cols = weight.shape[-2:]
    shape = (*weight.shape[:-2], -(-rows // block[0]), -(-cols // block[1]))
    scales = torch.empty(shape)
    quantized = torch.empty(weight.shape, dtype=torch.float8_e4m3fn)
    for index in itertools.product(*(range(n) for n in shape)):
        *lead, i, j = index
        part = (*lead, slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1]))
        scale = float(weight[part].abs().max()) / 448 or 1.0
        if power_of_two:
            scale = 2.0 ** torch.tensor(scale).log2().ceil().item()
        scales[index] = scale
        quantized[part] = (weight[part] / scale).to(torch.float8_e4m3fn)
    return quantized, scales


def reference_fp8(quantized: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Element by element: each value times the scale of the block holding it."""
    out = torch.empty(quantized.shape)
    for index in itertools.product(*(range(n) for n in quantized.shape)):
        *lead, r, c = index
        out[index] = float(quantized[index].float()) * float(scales[(*lead, r // block[0], c // block[1])].float())
    return out


def test_block_fp8_with_uneven_blocks_and_stacked_experts_matches_the_element_reference():
    gen = torch.Generator().manual_seed(0)
    weights = {"a.weight": torch.randn(10, 13, generator=gen), "experts.w13": torch.randn(3, 6, 17, generator=gen)}
    dequantizer = CheckpointDequantizer(FP8, torch.float32)
    for name, weight in weights.items():
        quantized, scales = fp8_block_quantize(weight, (4, 8))
        dense = dequantizer.dequantize(name, quantized, scales)
        assert dense.dtype == torch.float32
        torch.testing.assert_close(dense, reference_fp8(quantized, scales, (4, 8)), atol=0, rtol=0)
        torch.testing.assert_close(dense, weight, atol=0.1 * float(weight.abs().max()), rtol=0)  # FP8 rounding


def test_e8m0_scales_a_scalar_scale_and_the_output_dtype():
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(8, 16, generator=gen)
    quantized, scales = fp8_block_quantize(weight, (4, 8), power_of_two=True)
    dequantizer = CheckpointDequantizer(FP8, torch.bfloat16)
    dense = dequantizer.dequantize("w", quantized, scales.to(torch.float8_e8m0fnu))
    assert dense.dtype == torch.bfloat16
    torch.testing.assert_close(dense.float(), reference_fp8(quantized, scales, (4, 8)).bfloat16().float())
    scalar = torch.tensor(0.25)
    assert torch.equal(
        CheckpointDequantizer(FP8, torch.float32).dequantize("w", quantized, scalar), quantized.float() * 0.25
    )


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """[rows, 2n] e2m1 codes -> [rows, n] int8, even index in the low nibble."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)


def test_mxfp4_experts_unpack_low_nibble_first_and_scale_per_32_values():
    gen = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 16, (3, 64), generator=gen)
    exponents = torch.randint(120, 134, (3, 2), generator=gen).to(torch.uint8)
    scales = exponents.view(torch.float8_e8m0fnu)
    dense = CheckpointDequantizer(FP8, torch.float32).dequantize("experts.0.w1.weight", pack_fp4(codes), scales)
    expected = torch.tensor(
        [
            [E2M1_VALUES[int(codes[r, c])] * 2.0 ** (int(exponents[r, c // 32]) - 127) for c in range(64)]
            for r in range(3)
        ]
    )
    assert torch.equal(dense, expected)
    with pytest.raises(ValueError, match="one scale per 32"):
        CheckpointDequantizer(FP8, torch.float32).dequantize("x.weight", pack_fp4(codes), scales[:, :1])


def test_the_stream_pairs_weights_and_scales_in_either_order_and_passes_the_rest():
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(8, 8, generator=gen), torch.randn(8, 8, generator=gen)
    qa, sa = fp8_block_quantize(a, (4, 8))
    qb, sb = fp8_block_quantize(b, (4, 8))
    norm, hc_scale = torch.ones(8), torch.tensor([1.0, 2.0, 3.0])
    stream = [
        ("x.a.weight", qa),
        ("x.norm.weight", norm),
        ("x.b.scale", sb),
        ("x.a.weight_scale_inv", sa),
        ("x.attn_hc.scale", hc_scale),
        ("x.b.weight", qb),
    ]
    dequantizer = CheckpointDequantizer(FP8, torch.float32)
    out = dict(dequantize_stream(iter(stream), dequantizer))
    assert set(out) == {"x.a.weight", "x.b.weight", "x.norm.weight", "x.attn_hc.scale"}
    assert torch.equal(out["x.a.weight"], reference_fp8(qa, sa, (4, 8)))
    assert torch.equal(out["x.b.weight"], reference_fp8(qb, sb, (4, 8)))
    assert out["x.norm.weight"] is norm and out["x.attn_hc.scale"] is hc_scale and dequantizer.dequantized == 2


def test_a_weight_without_its_scale_and_a_scale_without_its_weight_are_errors():
    quantized, scales = fp8_block_quantize(torch.randn(8, 8), (4, 8))
    with pytest.raises(ValueError, match="no scale.*x.a.weight"):
        list(dequantize_stream(iter([("x.a.weight", quantized)]), CheckpointDequantizer(FP8, torch.float32)))
    with pytest.raises(ValueError, match="x.b.weight_scale_inv has no quantized weight"):
        list(dequantize_stream(iter([("x.b.weight_scale_inv", scales)]), CheckpointDequantizer(FP8, torch.float32)))
    with pytest.raises(ValueError, match="needs scales of shape"):
        CheckpointDequantizer(FP8, torch.float32).dequantize("x.a.weight", quantized, scales[:1])
    with pytest.raises(ValueError, match="fmt 'e5m2'"):
        CheckpointDequantizer({**FP8, "fmt": "e5m2"}, torch.float32)


def test_compressed_tensors_mxfp4_pairs_weight_packed_with_uint8_scales():
    """Kimi-K3's experts: ``X.weight_packed`` (uint8, even element in the low nibble) and
    ``X.weight_scale`` (uint8 biased exponents) become ``X.weight``; plain weights pass."""
    from engine.model_loader.dequant import dequantizable

    config = {"quant_method": "compressed-tensors", "config_groups": {"group_0": {"format": "mxfp4-pack-quantized"}}}
    assert dequantizable(config) and not dequantizable(
        {"quant_method": "compressed-tensors", "format": "int-quantized"}
    )
    gen = torch.Generator().manual_seed(4)
    codes = torch.randint(0, 16, (2, 64), generator=gen)
    exponents = torch.randint(120, 134, (2, 2), generator=gen).to(torch.uint8)
    plain = torch.randn(3, 3, generator=gen)
    stream = [
        ("e.w1.weight_scale", exponents),
        ("e.w1.weight_packed", pack_fp4(codes).view(torch.uint8)),
        ("norm.weight", plain),
    ]
    dequantizer = CheckpointDequantizer(config, torch.float32)
    out = dict(dequantize_stream(iter(stream), dequantizer))
    expected = torch.tensor(
        [
            [E2M1_VALUES[int(codes[r, c])] * 2.0 ** (int(exponents[r, c // 32]) - 127) for c in range(64)]
            for r in range(2)
        ]
    )
    assert set(out) == {"e.w1.weight", "norm.weight"} and torch.equal(out["e.w1.weight"], expected)
    assert out["norm.weight"] is plain


FLOAT_CHANNEL = {
    "quant_method": "compressed-tensors",
    "config_groups": {
        "group_0": {"format": "float-quantized", "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}
    },
}


def test_compressed_tensors_fp8_per_channel_per_tensor_and_per_group_drop_input_scales():
    """``X.weight`` (e4m3) with ``X.weight_scale``: [out, 1] per channel, one value per tensor,
    [out, in / group] per group; ``X.input_scale`` is left out."""
    gen = torch.Generator().manual_seed(5)
    q = (torch.randn(4, 64, generator=gen) * 50).to(torch.float8_e4m3fn)
    channel = torch.rand(4, 1, generator=gen) + 0.1
    tensor = torch.tensor([0.25])
    group = torch.rand(4, 2, generator=gen) + 0.1
    stream = [
        ("l.a.weight", q),
        ("l.a.weight_scale", channel),
        ("l.a.input_scale", torch.tensor([0.5])),
        ("l.b.weight_scale", tensor),
        ("l.b.weight", q),
        ("l.norm.weight", torch.ones(4)),
    ]
    dequantizer = CheckpointDequantizer(FLOAT_CHANNEL, torch.float32)
    out = dict(dequantize_stream(iter(stream), dequantizer))
    assert set(out) == {"l.a.weight", "l.b.weight", "l.norm.weight"} and dequantizer.dropped == 1
    values = q.float()
    expected_a = torch.tensor([[float(values[r, c]) * float(channel[r, 0]) for c in range(64)] for r in range(4)])
    assert torch.equal(out["l.a.weight"], expected_a) and torch.equal(out["l.b.weight"], values * 0.25)
    grouped = {
        **FLOAT_CHANNEL,
        "config_groups": {"g": {"format": "float-quantized", "weights": {"strategy": "group", "group_size": 32}}},
    }
    dense = CheckpointDequantizer(grouped, torch.float32).dequantize("l.c.weight", q, group)
    assert torch.equal(dense, torch.tensor(reference_fp8(q, group, (1, 32)).tolist()))
    # AutoFP8's per-tensor fp8: no weight_block_size, one ``weight_scale`` value
    per_tensor = dict(
        dequantize_stream(
            iter([("w.weight", q), ("w.weight_scale", tensor)]),
            CheckpointDequantizer({"quant_method": "fp8"}, torch.float32),
        )
    )
    assert torch.equal(per_tensor["w.weight"], values * 0.25)


def test_kept_quantized_weights_carry_their_scale_and_dense_places_refuse_fp8_without_one():
    from engine.layers.quantized_checkpoint import dense_tensor, quantized_checkpoint

    quantized, scales = fp8_block_quantize(torch.randn(8, 8), (4, 8))
    dequantizer = CheckpointDequantizer(FP8, torch.float32, keep_quantized=True)
    ((name, kept),) = list(dequantize_stream(iter([("x.a.scale", scales), ("x.a.weight", quantized)]), dequantizer))
    info = quantized_checkpoint(kept)
    assert name == "x.a.weight" and kept is quantized and dequantizer.kept == 1 and dequantizer.dequantized == 0
    assert (info.weight_name, info.scale_name) == ("weight", "weight_scale_inv") and info.scale is scales
    assert dense_tensor("x.a.weight", kept, torch.float8_e4m3fn) is kept  # an FP8 place takes it as it is
    torch.testing.assert_close(
        dense_tensor("x.a.weight", kept, torch.float32), reference_fp8(quantized, scales, (4, 8)), rtol=0, atol=0
    )
    assert dequantizer.dequantized == 1
    with pytest.raises(ValueError, match="x.b.weight is torch.float8_e4m3fn with no scale"):
        dense_tensor("x.b.weight", quantized.clone(), torch.bfloat16)
