"""engine-cpu's group_quant_linear kernel against the layout's formula and the torch reference
(engine.interfaces.group_quant), on every instruction-set build this CPU runs.

Both are compared with the exact value of sum_k x[t, k] (s q[n, k] - m) + bias[n], computed in
float64 from the integers, scales and offsets. fp32 outputs may differ from it by what summing
in float32 costs: a few float32 epsilons of the size of the terms, ``|x| @ (|s q| + |m|)^T``
(both the kernel and the reference stay within 1.5 of them here with one-level scales, and
within 4.1 with the two-level weights, whose groups hold values of one sign and so larger
partial sums). bf16 outputs: that, plus one rounding to bf16 (half a bf16 step).

With int8 activations (bf16 decode rows, builds with AVX512-VNNI), x is rounded to int8 per block
of min(group, 128) inputs (4 bits; 64 for 8) with the scale dx = max|x| / 127, so each input moves
by at most dx / 2 and the output by at most ``(dx / 2) @ |s q|^T`` more: the contract checked.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from engine.interfaces.group_quant import GroupQuantWeight, group_quant_linear
from engine.testing.oracles import group_quant_exact, group_quant_int8_allowance, random_group_quant
from engine_cpu import native
from engine_cpu.ops import NativeLayerOps

# 3 * 128 inputs. Group sizes 32, 128 and K take whole AVX-512 steps (and, with bf16 x beyond 8
# rows, the AMX tiles); 16, and 24 at 8 bits, the AVX2 steps and their tail; 6, and 24 at 4 bits,
# plain C++; from 9 rows, all but the AMX case dequantized fp32 tiles
K = 384
N = 77  # odd: the last parallel block is partial
FP32_EPSILONS = 6.0  # of the terms' size: the fp32 tolerance


@pytest.fixture(scope="module")
def ops(each_isa):
    return NativeLayerOps(native.load(), int8_activations=False)


@pytest.fixture(scope="module")
def int8_ops(each_isa):
    return NativeLayerOps(native.load(), int8_activations=True)


# (value bits, two-level scales, symmetric): 4 and 8 bits with float32 scales; 4 and 6 bits with
# int8 codes per group and float32 per super-block (the GGUF k-quants); symmetric ones, whose
# offsets are a zero times the scales (GPTQ sym, Q8_0, Q6_K, MXFP4's doubled e2m1 values)
LAYOUTS = [
    (4, False, False),
    (8, False, False),
    (4, True, False),
    (6, True, False),
    (4, False, True),
    (6, True, True),
    (6, False, True),
]


random_weight = functools.partial(random_group_quant, N, K)  # (bits, group_size, gen, **layout)


def assert_within_rounding(out: torch.Tensor, x: torch.Tensor, w: GroupQuantWeight, bias: torch.Tensor | None):
    exact, size = group_quant_exact(x, w, bias)
    bound = FP32_EPSILONS * torch.finfo(torch.float32).eps * size
    if out.dtype == torch.bfloat16:
        bound = bound * (1 + 2**-8) + 2**-8 * exact.abs()  # one rounding to bf16: half of its 2^-7 step
    error = (out.double() - exact).abs()
    worst = (error / bound).max().item()
    assert worst <= 1.0, f"error {worst:.2f} times the tolerance ({out.dtype}, {tuple(out.shape)})"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 8, 64, 300])
@pytest.mark.parametrize("group_size", [16, 32, 128, K, 24, 6])
@pytest.mark.parametrize(("bits", "two_level", "symmetric"), LAYOUTS)
def test_kernel_matches_the_layout_and_the_reference(ops, bits, two_level, symmetric, group_size, rows, dtype):
    if bits == 6 and group_size % 4:
        pytest.skip("6-bit values are stored in 6 bits in groups of whole 4 inputs")
    gen = torch.Generator().manual_seed(bits * 1000 + group_size * 10 + rows)
    w = random_weight(bits, group_size, gen, two_level=two_level, symmetric=symmetric)
    assert (w.bits, w.super_group > 0, w.zero is not None) == (bits, two_level, symmetric)
    x = torch.randn(rows, K, generator=gen).to(dtype)
    for bias in (None, torch.randn(N, generator=gen).to(dtype)):
        out = ops.group_quant_linear(x, w, bias)
        assert out.shape == (rows, N) and out.dtype == dtype
        assert_within_rounding(out, x, w, bias)
        reference = group_quant_linear(x, w, bias)
        assert_within_rounding(reference, x, w, bias)  # the tolerance holds the reference too
        if dtype == torch.bfloat16:  # both round float32 sums once: they differ only next to a tie
            assert (out != reference).float().mean().item() < 0.02


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize(("bits", "two_level", "symmetric"), LAYOUTS)
def test_input_order_gathers_the_inputs(ops, bits, two_level, symmetric, rows, dtype):
    gen = torch.Generator().manual_seed(rows + bits)
    w = random_weight(bits, 32, gen, ordered=True, two_level=two_level, symmetric=symmetric)
    x = torch.randn(2, rows, K, generator=gen).to(dtype)  # leading dimensions are kept
    bias = torch.randn(N, generator=gen)
    out = ops.group_quant_linear(x, w, bias)
    assert out.shape == (2, rows, N)
    assert_within_rounding(out.view(-1, N), x.view(-1, K), w, bias)
    # without its order the weight multiplies other inputs: the test can tell
    plain = dataclasses.replace(w, input_order=None)
    assert (ops.group_quant_linear(x, plain, bias).float() - out.float()).abs().max() > 0.1


def int8_block(bits: int, group_size: int) -> int:
    return min(group_size, 64 if bits == 8 else 128)


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("group_size", [16, 32, 64, 128, K])
@pytest.mark.parametrize(("bits", "two_level", "symmetric"), LAYOUTS)
def test_int8_activations_stay_within_their_contract(int8_ops, ops, bits, two_level, symmetric, group_size, rows):
    kernels = int8_ops.kernels
    vnni = "avx512_vnni" in native.chosen_variant().requires
    supported = kernels.group_quant_int8_supported(bits, K, group_size)
    assert supported == vnni  # every size here: whole chunks, blocks of whole lanes
    if not supported:
        pytest.skip(f"the {kernels.variant} build has no int8 activations for {bits} bits, groups of {group_size}")
    gen = torch.Generator().manual_seed(bits * 7 + group_size + rows)
    w = random_weight(bits, group_size, gen, two_level=two_level, symmetric=symmetric)
    x = (torch.randn(rows, K, generator=gen) * torch.rand(rows, K, generator=gen) * 3).bfloat16()
    bias = torch.randn(N, generator=gen)
    out = int8_ops.group_quant_linear(x, w, bias)
    exact, size = group_quant_exact(x, w, bias)
    activations = group_quant_int8_allowance(x, w, int8_block(bits, group_size))
    bound = FP32_EPSILONS * torch.finfo(torch.float32).eps * size + activations
    bound = bound * (1 + 2**-8) + 2**-8 * exact.abs()
    error = (out.double() - exact).abs()
    assert (error / bound).max().item() <= 1.0
    # the int8 path ran: it differs from the exact kernel well past bf16 ties, and stays close
    plain = ops.group_quant_linear(x, w, bias)
    assert (out != plain).float().mean().item() > 0.1
    assert ((out.double() - exact).abs() / size).median().item() < 2e-3


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("inputs", [512, 896, 1408])  # whole windows of 16 groups, then 3 chunks past them
@pytest.mark.parametrize(("two_level", "symmetric"), [(False, False), (True, False), (False, True)])
def test_decode_rows_of_4_bits_in_groups_of_32_take_windows(int8_ops, inputs, two_level, symmetric, rows):
    """Decode rows against 4-bit groups of 32 take windows of 512 inputs transposed in
    registers (and the chunks past the last whole window one at a time): the int8 contract,
    and each row as it comes out alone, but next to a bf16 tie."""
    if not int8_ops.kernels.group_quant_int8_supported(4, inputs, 32):
        pytest.skip(f"the {int8_ops.kernels.variant} build has no int8 activations")
    gen = torch.Generator().manual_seed(inputs * rows + 2 * two_level + symmetric)
    w = random_group_quant(N, inputs, 4, 32, gen, two_level=two_level, symmetric=symmetric)
    x = (torch.randn(rows, inputs, generator=gen) * torch.rand(rows, inputs, generator=gen) * 3).bfloat16()
    bias = torch.randn(N, generator=gen)
    out = int8_ops.group_quant_linear(x, w, bias)
    exact, size = group_quant_exact(x, w, bias)
    bound = FP32_EPSILONS * torch.finfo(torch.float32).eps * size + group_quant_int8_allowance(x, w, 32)
    bound = bound * (1 + 2**-8) + 2**-8 * exact.abs()
    assert ((out.double() - exact).abs() / bound).max().item() <= 1.0
    alone = torch.cat([int8_ops.group_quant_linear(x[i : i + 1], w, bias) for i in range(rows)])
    assert (out != alone).float().mean().item() < 0.05
    assert ((out.double() - alone.double()).abs() <= 2**-7 * exact.abs() + 1e-6 * size).all()


def test_int8_activations_are_a_switch(monkeypatch):
    monkeypatch.setenv("ENGINE_CPU_INT8_ACTIVATIONS", "0")
    assert not NativeLayerOps(native.load()).int8_activations
    monkeypatch.delenv("ENGINE_CPU_INT8_ACTIVATIONS")
    assert NativeLayerOps(native.load()).int8_activations


def test_other_dtypes_fall_back_to_the_reference(ops):
    gen = torch.Generator().manual_seed(5)
    w = random_weight(4, 32, gen)
    x = torch.randn(3, K, generator=gen).to(torch.float16)
    assert torch.equal(ops.group_quant_linear(x, w), group_quant_linear(x, w))


def test_kernel_refuses_what_it_cannot_take(ops):
    gen = torch.Generator().manual_seed(6)
    w = random_weight(4, 32, gen)
    x = torch.randn(2, K, generator=gen)
    out = torch.empty(2, N)
    none, no_supers = torch.empty(0), torch.empty(0, 0)

    def call(out, w, bits, group_size, super_group=0, supers=(no_supers, no_supers), zero=-1):
        ops.kernels.group_quant_linear(
            out, x, w.qweight, w.scales, w.offsets, *supers, bits, group_size, super_group, zero, none, False
        )

    with pytest.raises(RuntimeError, match="4, 6 or 8 bits"):
        call(out, w, 5, 32)
    with pytest.raises(RuntimeError, match="qweight"):
        call(out, w, 8, 32)
    with pytest.raises(RuntimeError, match="out must have x's dtype"):
        call(out.bfloat16(), w, 4, 32)
    with pytest.raises(RuntimeError, match="scales and offsets"):
        call(out, w, 4, 64)
    with pytest.raises(RuntimeError, match="int8"):  # float32 scales given as two-level codes
        call(out, w, 4, 32, 4, (w.scales[:, :3].contiguous(), w.scales[:, :3].contiguous()))
    with pytest.raises(RuntimeError, match="on the CPU"):
        ops.kernels.group_quant_matmul(
            x, w.qweight.to("meta"), w.scales, w.offsets, None, None, 4, 32, 0, -1, None, False
        )
    made = ops.kernels.group_quant_matmul(x, w.qweight, w.scales, w.offsets, None, None, 4, 32, 0, -1, None, False)
    assert made.shape == (2, N) and made.dtype == x.dtype
    with pytest.raises(RuntimeError, match="zero 300"):
        call(out, w, 4, 32, zero=300)
    with pytest.raises(RuntimeError, match="scales and offsets"):  # no zero, no offsets
        ops.kernels.group_quant_matmul(x, w.qweight, w.scales, None, None, None, 4, 32, 0, -1, None, False)
    assert_within_rounding(made, x, w, None)
    two = random_weight(6, 32, gen, two_level=True)
    with pytest.raises(RuntimeError, match="super_group"):
        call(out, two, 6, 32, 3, (two.super_scales, two.super_offsets))
    with pytest.raises(RuntimeError, match="super_scales and super_offsets"):
        call(out, two, 6, 32, two.super_group, (two.super_scales[:, :1].contiguous(), two.super_offsets))
