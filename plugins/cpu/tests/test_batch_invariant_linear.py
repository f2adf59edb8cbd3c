"""--batch-invariant linear layers on the CPU: each row bitwise the same in any batch, for the
fixed-order gemv (AVX512-BF16) and dot_linear (any CPU, fp32 and bf16)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.layers.linear import MergedLinear
from engine_cpu import native
from engine_cpu.linear import pack_gemv_weight
from engine_cpu.platform import CpuPlatform

gemv_kernels = pytest.mark.usefixtures("gemv_kernels")


def fp32_reference(x, weight, bias):
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float())


@gemv_kernels
@pytest.mark.parametrize("n, k", [(100, 512), (1000, 1408)])
@pytest.mark.parametrize("bias", [False, True])
def test_batch_invariant_gemv_gives_each_row_the_same_bits_in_any_batch(n, k, bias):
    """--batch-invariant: a row's result is bitwise the same alone and at any place of a batch
    of any size (the tuned gemv changes its accumulators at 4 rows and its passes at 16)."""
    gen = torch.Generator().manual_seed(n + k)
    weight = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else torch.empty(0, dtype=torch.bfloat16)
    packed = pack_gemv_weight(weight)
    kernels = native.load()
    x = torch.randn(70, k, generator=gen).bfloat16()

    def product(rows):
        out = torch.empty(rows.shape[0], n, dtype=torch.bfloat16)
        kernels.gemv(out, rows, packed, b, True)
        return out

    alone = torch.cat([product(x[i : i + 1]) for i in range(70)])
    for m in (2, 3, 4, 5, 15, 16, 17, 33, 64, 70):
        start = (m * 7) % (70 - m + 1)
        assert torch.equal(product(x[start : start + m]), alone[start : start + m]), m
    expected = fp32_reference(x, weight, b if bias else None)
    assert torch.allclose(alone.float(), expected, rtol=2**-8, atol=1e-3 * expected.abs().max().item())


@gemv_kernels
def test_platform_batch_invariant_method_runs_every_row_count_through_fixed_order_gemv():
    from engine_cpu.linear import BatchInvariantGemvLinearMethod

    method = CpuPlatform().batch_invariant_linear_method("bfloat16")
    assert isinstance(method, BatchInvariantGemvLinearMethod) and method.batch_invariant
    gen = torch.Generator().manual_seed(3)
    layer = MergedLinear(64, [48, 48], True, torch.bfloat16)
    layer.weight.data.copy_(torch.randn(96, 64, generator=gen))
    layer.bias.data.copy_(torch.randn(96, generator=gen))
    layer.method = method
    method.process_weights_after_loading(layer)
    x = torch.randn(300, 64, generator=gen).bfloat16()
    whole = layer(x)
    assert torch.equal(torch.cat([layer(x[i : i + 1]) for i in range(300)]), whole)
    expected = fp32_reference(x, layer.weight.data, layer.bias.data)
    assert torch.allclose(whole.float(), expected, rtol=2**-7, atol=1e-2 * expected.abs().max().item())


native_kernels = pytest.mark.usefixtures("each_isa")


@native_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n, k", [(100, 512), (33, 70), (1000, 1408)])
def test_dot_linear_gives_each_row_the_same_bits_in_any_batch(dtype, n, k):
    """The fixed-order kernel of --batch-invariant on CPUs without AVX512-BF16 (and in fp32)."""
    gen = torch.Generator().manual_seed(n + k)
    weight = torch.randn(n, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    x = torch.randn(70, k, generator=gen).to(dtype)
    kernels = native.load()

    def product(rows, b):
        out = torch.empty(rows.shape[0], n, dtype=dtype)
        kernels.dot_linear(out, rows, weight, b)
        return out

    alone = torch.cat([product(x[i : i + 1], bias) for i in range(70)])
    for m in (2, 3, 8, 17, 64, 70):
        start = (m * 7) % (70 - m + 1)
        assert torch.equal(product(x[start : start + m], bias), alone[start : start + m]), m
    expected = fp32_reference(x, weight, bias)
    tol = 2**-8 if dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(alone.float(), expected, rtol=tol, atol=tol * expected.abs().max().item())
    no_bias = product(x, torch.empty(0, dtype=dtype))
    assert torch.allclose(
        no_bias.float(), fp32_reference(x, weight, None), rtol=tol, atol=tol * expected.abs().max().item()
    )
    with pytest.raises(RuntimeError, match="share a dtype"):
        kernels.dot_linear(torch.empty(1, n, dtype=torch.float64), x[:1], weight, torch.empty(0, dtype=dtype))


@native_kernels
def test_platform_batch_invariant_methods_by_dtype_and_cpu(monkeypatch):
    from engine_cpu.linear import BatchInvariantGemvLinearMethod, DotLinearMethod

    platform = CpuPlatform()
    assert isinstance(platform.batch_invariant_linear_method("float32"), DotLinearMethod)
    gemv = native.load().gemv_supported()
    expected = BatchInvariantGemvLinearMethod if gemv else DotLinearMethod
    assert isinstance(platform.batch_invariant_linear_method("bfloat16"), expected)
    assert platform.batch_invariant_linear_method("float16") is None  # the engine goes row by row
    # a CPU without AVX512-BF16, faked: dot_linear serves bf16 too
    monkeypatch.setattr(native.load(), "gemv_supported", lambda: False, raising=False)
    assert isinstance(platform.batch_invariant_linear_method("bfloat16"), DotLinearMethod)
