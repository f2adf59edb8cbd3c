"""engine-cpu's group_quant_linear kernel against the layout's formula and the torch reference
(engine.interfaces.group_quant), on every instruction-set build this CPU runs.

Both are compared with the exact value of sum_k x[t, k] (s q[n, k] - m) + bias[n], computed in
float64 from the integers, scales and offsets. fp32 outputs may differ from it by what summing
in float32 costs: a few float32 epsilons of the size of the terms, ``|x| @ (|s q| + |m|)^T``
(both the kernel and the reference stay within 1.5 of them here). bf16 outputs: that, plus one
rounding to bf16 (half a bf16 step).

With int8 activations (bf16 decode rows, builds with AVX512-VNNI), x is rounded to int8 per block
of min(group, 128) inputs (4 bits; 64 for 8) with the scale dx = max|x| / 127, so each input moves
by at most dx / 2 and the output by at most ``(dx / 2) @ |s q|^T`` more: the contract checked.
"""

from __future__ import annotations

import pytest
import torch

from engine.interfaces.group_quant import GroupQuantWeight, group_quant_linear
from engine.testing.oracles import group_quant_exact, group_quant_int8_allowance
from engine_cpu import native
from engine_cpu.ops import NativeLayerOps

# 3 * 128 inputs. Group sizes 32, 128 and K take whole AVX-512 steps (and, with bf16 x beyond 8
# rows, the AMX tiles); 16, and 24 at 8 bits, the AVX2 steps and their tail; 6, and 24 at 4 bits,
# plain C++; from 9 rows, all but the AMX case dequantized fp32 tiles
K = 384
N = 77  # odd: the last parallel block is partial
FP32_EPSILONS = 4.0  # of the terms' size: the fp32 tolerance


@pytest.fixture(scope="module")
def ops(each_isa):
    return NativeLayerOps(native.load(), int8_activations=False)


@pytest.fixture(scope="module")
def int8_ops(each_isa):
    return NativeLayerOps(native.load(), int8_activations=True)


def random_weight(bits: int, group_size: int, gen: torch.Generator, *, ordered: bool = False) -> GroupQuantWeight:
    values = torch.randint(0, 1 << bits, (N, K), generator=gen, dtype=torch.uint8)
    scales = torch.rand(N, K // group_size, generator=gen) * 0.05 + 0.001
    zeros = torch.randint(0, 1 << bits, (N, K // group_size), generator=gen).float()
    order = torch.randperm(K, generator=gen) if ordered else None
    return GroupQuantWeight.from_values(values, scales, scales * zeros, bits, input_order=order)


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
@pytest.mark.parametrize("bits", [4, 8])
def test_kernel_matches_the_layout_and_the_reference(ops, bits, group_size, rows, dtype):
    gen = torch.Generator().manual_seed(bits * 1000 + group_size * 10 + rows)
    w = random_weight(bits, group_size, gen)
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
@pytest.mark.parametrize("bits", [4, 8])
def test_input_order_gathers_the_inputs(ops, bits, rows, dtype):
    gen = torch.Generator().manual_seed(rows + bits)
    w = random_weight(bits, 32, gen, ordered=True)
    x = torch.randn(2, rows, K, generator=gen).to(dtype)  # leading dimensions are kept
    bias = torch.randn(N, generator=gen)
    out = ops.group_quant_linear(x, w, bias)
    assert out.shape == (2, rows, N)
    assert_within_rounding(out.view(-1, N), x.view(-1, K), w, bias)
    # without its order the weight multiplies other inputs: the test can tell
    plain = GroupQuantWeight(w.qweight, w.scales, w.offsets, bits, 32, K, N)
    assert (ops.group_quant_linear(x, plain, bias).float() - out.float()).abs().max() > 0.1


def int8_block(bits: int, group_size: int) -> int:
    return min(group_size, 128 if bits == 4 else 64)


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("group_size", [16, 32, 64, 128, K])
@pytest.mark.parametrize("bits", [4, 8])
def test_int8_activations_stay_within_their_contract(int8_ops, ops, bits, group_size, rows):
    kernels = int8_ops.kernels
    vnni = "avx512_vnni" in native.chosen_variant().requires
    supported = kernels.group_quant_int8_supported(bits, K, group_size)
    assert supported == vnni  # every size here: whole chunks, blocks of whole lanes
    if not supported:
        pytest.skip(f"the {kernels.variant} build has no int8 activations for {bits} bits, groups of {group_size}")
    gen = torch.Generator().manual_seed(bits * 7 + group_size + rows)
    w = random_weight(bits, group_size, gen)
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
    none = torch.empty(0)
    with pytest.raises(RuntimeError, match="4 or 8 bits"):
        ops.kernels.group_quant_linear(out, x, w.qweight, w.scales, w.offsets, 5, 32, none)
    with pytest.raises(RuntimeError, match="qweight"):
        ops.kernels.group_quant_linear(out, x, w.qweight, w.scales, w.offsets, 8, 32, none)
    with pytest.raises(RuntimeError, match="out must have x's dtype"):
        ops.kernels.group_quant_linear(out.bfloat16(), x, w.qweight, w.scales, w.offsets, 4, 32, none)
    with pytest.raises(RuntimeError, match="scales and offsets"):
        ops.kernels.group_quant_linear(out, x, w.qweight, w.scales, w.offsets, 4, 64, none)
