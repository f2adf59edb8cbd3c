"""The group-quantized weight layout (engine.interfaces.group_quant) against its definition
written out plainly: W[n, k] = scales[n, k // g] * q[n, k] - offsets[n, k // g], 4-bit values two
a byte (even k in the low nibble), 6-bit values as their low nibbles so, then their top 2 bits
four a byte, two-level scales as code times the super-block's float, inputs gathered by
input_order."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.interfaces import group_quant
from engine.interfaces.group_quant import GroupQuantWeight, group_quant_linear, pack, quantize_groups, unpack
from engine.interfaces.ops import REFERENCE_OPS


def plain_bytes(values: list[list[int]], bits: int) -> list[list[int]]:
    if bits == 8:
        return [list(row) for row in values]
    rows = []
    for row in values:
        nibbles = [(row[2 * i] & 15) | ((row[2 * i + 1] & 15) << 4) for i in range(len(row) // 2)]
        tops = []  # 6 bits: 32 bytes per 128 inputs, byte i: inputs 2i, 2i + 64, 2i + 1, 2i + 65
        for c in range(0, len(row) if bits == 6 else 0, 128):
            for i in range(32):
                fields = (row[c + 2 * i], row[c + 2 * i + 64], row[c + 2 * i + 1], row[c + 2 * i + 65])
                tops.append(sum((v >> 4) << (2 * j) for j, v in enumerate(fields)))
        rows.append(nibbles + tops)
    return rows


def plain_linear(x, values, scales, offsets, group_size, bias, order):
    """sum_k x[t, order[k]] * (scales[n][k // g] * q[n][k] - offsets[n][k // g]) + bias[n], in float64."""
    out = []
    for row in x:
        out.append(
            [
                sum(
                    row[order[k]] * (scales[n][k // group_size] * values[n][k] - offsets[n][k // group_size])
                    for k in range(len(values[n]))
                )
                + (bias[n] if bias is not None else 0.0)
                for n in range(len(values))
            ]
        )
    return out


@pytest.mark.parametrize("two_level", [False, True])
@pytest.mark.parametrize("ordered", [False, True])
@pytest.mark.parametrize("bits", [4, 6, 8])
def test_reference_follows_the_layout(bits, ordered, two_level):
    gen = torch.Generator().manual_seed(bits)
    n, k, g = 3, 256, 64  # 6 bits: two chunks of 128 inputs' top bits
    values = torch.randint(0, 1 << bits, (n, k), generator=gen)
    order = torch.randperm(k, generator=gen) if ordered else None
    if two_level:  # two super-blocks of two groups a row
        codes, zero_codes = torch.randint(-128, 128, (2, n, k // g), generator=gen)
        units, zero_units = (torch.rand(2, n, 2, generator=gen) + 0.5) / 64
        w = GroupQuantWeight.from_values(
            values, codes, zero_codes, bits, input_order=order, super_scales=units, super_offsets=zero_units
        )
        assert (w.scales.dtype, w.super_group) == (torch.int8, 2)
        scales = torch.tensor([[units[r][j // 2] * codes[r][j] for j in range(k // g)] for r in range(n)])
        offsets = torch.tensor([[zero_units[r][j // 2] * zero_codes[r][j] for j in range(k // g)] for r in range(n)])
    else:
        scales = torch.rand(n, k // g, generator=gen) + 0.5
        offsets = torch.randn(n, k // g, generator=gen)
        w = GroupQuantWeight.from_values(values, scales, offsets, bits, input_order=order)
    assert w.qweight.tolist() == plain_bytes(values.tolist(), bits)
    assert (w.bits, w.group_size, w.in_features, w.out_features) == (bits, g, k, n)
    assert torch.equal(w.values(), values.to(torch.uint8))
    x = torch.randn(2, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    expected = plain_linear(
        x.double().tolist(),
        values.tolist(),
        scales.double().tolist(),
        offsets.double().tolist(),
        g,
        bias.double().tolist(),
        order.tolist() if ordered else list(range(k)),
    )
    got = group_quant_linear(x, w, bias)
    torch.testing.assert_close(got.double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(REFERENCE_OPS.group_quant_linear(x, w, bias), got, rtol=0, atol=0)
    # bf16 x: its values as bf16 holds them, the result rounded to bf16 once
    xb = x.bfloat16()
    expected_b = torch.tensor(
        plain_linear(
            xb.double().tolist(),
            values.tolist(),
            scales.double().tolist(),
            offsets.double().tolist(),
            g,
            None,
            order.tolist() if ordered else list(range(k)),
        )
    )
    got_b = group_quant_linear(xb, w)
    assert got_b.dtype == torch.bfloat16
    torch.testing.assert_close(got_b.double(), expected_b.to(torch.bfloat16).double(), rtol=2**-8, atol=1e-5)


@pytest.mark.parametrize("bits", [4, 6])
def test_reference_in_blocks_equals_the_dense_product(monkeypatch, bits):
    """The reference works a block of inputs at a time: a product over several blocks is the
    dense one (6 bits: blocks of whole 128-input chunks of top bits)."""
    monkeypatch.setattr(group_quant, "BLOCK_ELEMENTS", 64 * 32)  # 64 outputs: blocks of 32 inputs (6 bits: 128)
    gen = torch.Generator().manual_seed(3)
    w = quantize_groups(torch.randn(64, 512, generator=gen), bits, 16, super_group=4 if bits == 6 else 0)
    w = dataclasses.replace(w, input_order=torch.randperm(512, generator=gen))
    x = torch.randn(5, 512, generator=gen)
    dense = x.double()[:, w.input_order] @ w.dequantize().double().t()
    torch.testing.assert_close(group_quant_linear(x, w).double(), dense, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits", [4, 6, 8])
def test_pack_unpack_round_trip(bits):
    gen = torch.Generator().manual_seed(bits)
    values = torch.randint(0, 1 << bits, (7, 384), generator=gen, dtype=torch.uint8)
    packed = pack(values, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (7, 384 * bits // 8)
    assert torch.equal(unpack(packed, bits), values)
    w = GroupQuantWeight.from_values(values, torch.ones(7, 3), torch.zeros(7, 3), bits)
    assert torch.equal(w.values(), values)
    assert torch.equal(w.dequantize(), values.float())
    assert w.zero == 0 and w.nbytes == 7 * 384 * bits // 8 + 7 * 3 * 4  # zero offsets: a zero of 0, no tensor


def test_two_level_scales_hold_their_bytes_and_values():
    """Two levels hold a byte a group and a float32 a super-block; their product is each group's
    float32 scale, so ``one_level`` and the reference give the very same values."""
    gen = torch.Generator().manual_seed(11)
    w = quantize_groups(torch.randn(6, 512, generator=gen), 4, 32, super_group=8)
    assert (w.scales.dtype, w.super_scales.shape, w.super_group) == (torch.int8, (6, 2), 8)
    assert w.nbytes == 6 * 256 + 2 * 6 * 16 + 2 * 6 * 2 * 4  # 4.75 bits an input
    flat = w.one_level()
    assert flat.super_group == 0 and flat.scales.dtype == torch.float32
    assert torch.equal(flat.scales, w.super_scales.repeat_interleave(8, 1) * w.scales.float())
    assert torch.equal(flat.dequantize(), w.dequantize())
    x = torch.randn(3, 512, generator=gen)
    assert torch.equal(group_quant_linear(x, flat), group_quant_linear(x, w))
    joined = group_quant.join([w, w])
    assert joined.super_scales.shape == (12, 2) and torch.equal(joined.dequantize()[6:], w.dequantize())
    assert not group_quant.joinable(w, flat)


def test_two_level_layout_refuses_what_it_cannot_hold():
    values = torch.zeros(2, 64, dtype=torch.uint8)
    units = torch.ones(2, 1)
    with pytest.raises(ValueError, match=r"integer codes in \[-128, 127\]"):
        GroupQuantWeight.from_values(
            values, torch.full((2, 2), 200), torch.zeros(2, 2), 4, super_scales=units, super_offsets=units
        )
    with pytest.raises(ValueError, match="come together"):
        GroupQuantWeight.from_values(values, torch.ones(2, 2), torch.zeros(2, 2), 4, super_scales=units)
    with pytest.raises(ValueError, match="power of two"):  # 6 groups of 8, 3 a super-block
        GroupQuantWeight.from_values(
            values[:, :48],
            torch.ones(2, 6),
            torch.zeros(2, 6),
            4,
            super_scales=torch.ones(2, 2),
            super_offsets=torch.ones(2, 2),
        )
    w = quantize_groups(torch.randn(2, 64), 4, 32, super_group=2)
    with pytest.raises(ValueError, match="super_scales"):
        dataclasses.replace(w, super_scales=None)
    with pytest.raises(ValueError, match="torch.int8"):
        dataclasses.replace(w, scales=w.scales.float())


@pytest.mark.parametrize("bits", [4, 6])
def test_two_level_quantization_keeps_the_error_of_a_step(bits):
    """quantize_groups with super-blocks: each value within half a step of its group's coded
    scale, or clamped at the range's ends by at most the offset's code rounding."""
    gen = torch.Generator().manual_seed(bits)
    weight = torch.randn(16, 256, generator=gen)
    w = quantize_groups(weight, bits, 32, super_group=8)
    assert (w.bits, w.super_group) == (bits, 8)
    step = w.group_scales().repeat_interleave(32, 1)
    slack = w.super_offsets.repeat_interleave(256, 1) / 2
    assert ((w.dequantize() - weight).abs() <= step / 2 * (1 + 1e-5) + slack + 1e-6).all()


def test_small_widths_are_stored_in_the_next_storage():
    values = torch.randint(0, 8, (2, 128), generator=torch.Generator().manual_seed(0))
    assert GroupQuantWeight.from_values(values, torch.ones(2, 1), torch.zeros(2, 1), 3).bits == 4
    assert GroupQuantWeight.from_values(values, torch.ones(2, 1), torch.zeros(2, 1), 6).bits == 6
    assert GroupQuantWeight.from_values(values, torch.ones(2, 64), torch.zeros(2, 64), 5).bits == 6  # groups of 2
    assert GroupQuantWeight.from_values(values[:, :96], torch.ones(2, 1), torch.zeros(2, 1), 5).bits == 8  # no chunk
    assert GroupQuantWeight.from_values(values, torch.ones(2, 1), torch.zeros(2, 1), 7).bits == 8


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_groups_error_is_half_a_step(bits, symmetric):
    gen = torch.Generator().manual_seed(bits)
    weight = torch.randn(16, 256, generator=gen)
    w = quantize_groups(weight, bits, 32, symmetric=symmetric)
    assert (w.bits, w.group_size) == (bits, 32)
    error = (w.dequantize() - weight).abs().view(16, 8, 32)
    half_step = w.scales.unsqueeze(-1) / 2
    assert (error <= half_step * (1 + 1e-5) + 1e-7).all()
    assert error.max() > half_step.min() / 4  # it does round
    if symmetric:  # the zero at 2**(bits-1): offset = scale * 2**(bits-1), held as that zero
        assert w.zero == 1 << (bits - 1) and w.offsets is None
        torch.testing.assert_close(w.group_offsets(), w.scales * (1 << (bits - 1)))
    else:
        assert w.zero is None and w.offsets is not None


def test_quantize_groups_keeps_zero_exact():
    weight = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    weight[:, ::5] = 0
    assert (quantize_groups(weight, 4, 16).dequantize()[:, ::5].abs() < 1e-6).all()


def test_layout_validation():
    q4 = torch.zeros(2, 4, dtype=torch.uint8)
    s = torch.ones(2, 2)
    with pytest.raises(ValueError, match="stored in"):
        GroupQuantWeight(q4, s, s, 5, 4, 8, 2)
    with pytest.raises(ValueError, match="must be even and divide"):
        GroupQuantWeight(q4, s, s, 4, 3, 8, 2)
    with pytest.raises(ValueError, match="must be even and divide"):
        GroupQuantWeight(q4, torch.ones(2, 1), torch.ones(2, 1), 4, 6, 8, 2)
    with pytest.raises(ValueError, match=r"qweight is \(2, 8\).*stored as \(2, 4\) torch.uint8"):
        GroupQuantWeight(torch.zeros(2, 8, dtype=torch.uint8), s, s, 4, 4, 8, 2)
    with pytest.raises(ValueError, match="qweight is"):
        GroupQuantWeight(q4.to(torch.int8), s, s, 4, 4, 8, 2)
    with pytest.raises(ValueError, match=r"scales is \(2, 1\)"):
        GroupQuantWeight(q4, torch.ones(2, 1), s, 4, 4, 8, 2)
    with pytest.raises(ValueError, match="offsets is"):
        GroupQuantWeight(q4, s, s.double(), 4, 4, 8, 2)
    with pytest.raises(ValueError, match="input_order"):
        GroupQuantWeight(q4, s, s, 4, 4, 8, 2, input_order=torch.arange(8, dtype=torch.int32))
    with pytest.raises(ValueError, match="input_order"):
        GroupQuantWeight(q4, s, s, 4, 4, 8, 2, input_order=torch.arange(7))
    assert GroupQuantWeight(q4, s, s, 4, 4, 8, 2).nbytes == 8 + 16 + 16


def test_from_values_validation():
    with pytest.raises(ValueError, match=r"4-bit values must lie in \[0, 16\), got 0..16"):
        GroupQuantWeight.from_values(torch.tensor([[0, 16]]), torch.ones(1, 1), torch.zeros(1, 1), 4)
    with pytest.raises(ValueError, match="got -1"):
        GroupQuantWeight.from_values(torch.tensor([[-1, 3]]), torch.ones(1, 1), torch.zeros(1, 1), 8)
    with pytest.raises(ValueError, match="cannot be stored in a byte"):
        GroupQuantWeight.from_values(torch.zeros(1, 2), torch.ones(1, 1), torch.zeros(1, 1), 9)
    with pytest.raises(ValueError, match="3 groups do not divide the 8 inputs"):
        GroupQuantWeight.from_values(torch.zeros(1, 8), torch.ones(1, 3), torch.zeros(1, 3), 4)
    with pytest.raises(ValueError, match="4-bit needs an even K"):
        pack(torch.zeros(2, 3, dtype=torch.uint8), 4)
    with pytest.raises(ValueError, match="does not divide"):
        quantize_groups(torch.zeros(2, 10), 4, 4)
