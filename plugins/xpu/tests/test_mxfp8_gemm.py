"""The blockwise MXFP8 GEMM (engine_xpu.mxfp8_gemm) under the Triton interpreter, against
``x @ mxfp8_dequantize(W).T``, and the mxfp8 layer running it."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined: run them on the CPU

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from engine.layers.linear import MergedLinear  # noqa: E402
from engine_xpu import quantizer as quantizer_module  # noqa: E402
from engine_xpu.mxfp8 import mxfp8_dequantize, mxfp8_quantize  # noqa: E402
from engine_xpu.mxfp8_gemm import mxfp8_linear  # noqa: E402
from engine_xpu.quantizer import Mxfp8Quantizer  # noqa: E402

E8M0 = getattr(torch, "float8_e8m0fnu", None)


def random_problem(m, n, k, seed):
    """x [m, k], an MXFP8 weight [n, k] whose 32-wide blocks differ in magnitude by up to
    e^±8 (a wrong block's scale shows), bias [n]."""
    gen = torch.Generator().manual_seed(seed)
    magnitudes = torch.exp(4 * torch.randn(n, -(-k // 32), generator=gen)).repeat_interleave(32, 1)[:, :k]
    elements, scales = mxfp8_quantize(torch.randn(n, k, generator=gen) * magnitudes)
    return torch.randn(m, k, generator=gen), elements, scales, torch.randn(n, generator=gen)


def reference(x, elements, scales, bias):
    return x.double() @ mxfp8_dequantize(elements, scales).double().T + (0 if bias is None else bias.double())


def assert_close_relative(y, expected, tolerance):
    """|y - expected| within ``tolerance`` of expected's largest magnitude, elementwise."""
    scale = expected.abs().max().item()
    error = (y.double() - expected).abs().max().item() / scale
    assert error <= tolerance, f"largest difference {error:.2e} of the output's scale"


# (M, N, K, block_m, block_n, block_k): M past a tile edge, N odd, K = 32·n (a K tile half
# masked, several K tiles), a decode row, a short last block of 32
SHAPES = [
    (5, 33, 64, 16, 16, 32),
    (37, 17, 96, 16, 16, 64),
    (1, 64, 256, None, 64, 64),
    (20, 7, 128, 16, 16, 128),
    (3, 24, 40, 16, 16, 32),
]


@pytest.mark.parametrize("m, n, k, block_m, block_n, block_k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_float32_gemm_matches_the_dequantized_product(m, n, k, block_m, block_n, block_k, bias):
    x, elements, scales, b = random_problem(m, n, k, seed=m * 1000 + n * 10 + k)
    b = b if bias else None
    y = mxfp8_linear(x, elements, scales, b, block_m=block_m, block_n=block_n, block_k=block_k)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert_close_relative(y, reference(x, elements, scales, b), 1e-3)


@pytest.mark.parametrize("m, n, k, block_m, block_n, block_k", SHAPES[:3])
def test_bf16_gemm_is_the_float32_product_within_one_bf16_step(m, n, k, block_m, block_n, block_k):
    """bf16 activations and bias: the float32 sum converted to bf16 once (a GPU rounds to
    nearest; the Triton interpreter truncates, so the bound is one step, 2^-7 relative)."""
    x, elements, scales, bias = random_problem(m, n, k, seed=7 + m)
    x, bias = x.bfloat16(), bias.bfloat16()
    y = mxfp8_linear(x, elements, scales, bias, block_m=block_m, block_n=block_n, block_k=block_k)
    assert y.dtype == torch.bfloat16
    expected = reference(x, elements, scales, bias)
    assert ((y.double() - expected).abs() <= expected.abs() * 2**-7 + 1e-6 * expected.abs().max()).all()


def test_leading_dims_strided_rows_and_e8m0_scales():
    x, elements, scales, bias = random_problem(6, 48, 64, seed=11)
    wide = torch.randn(6, 80)
    wide[:, 8:72] = x  # rows 80 apart in memory
    expected = reference(x, elements, scales, bias)
    y = mxfp8_linear(wide[:, 8:72].view(2, 3, 64), elements, scales, bias, block_n=32, block_k=32)
    assert y.shape == (2, 3, 48)
    assert_close_relative(y.view(6, 48), expected, 1e-3)
    if E8M0 is not None:
        y = mxfp8_linear(x, elements, scales.view(E8M0), bias, block_n=32, block_k=32)
        assert_close_relative(y, expected, 1e-3)
    assert mxfp8_linear(x[:0], elements, scales, bias).shape == (0, 48)


def test_bad_tiles_and_shapes_are_refused():
    x, elements, scales, _ = random_problem(2, 16, 64, seed=12)
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp8_linear(x, elements, scales, block_k=48)
    with pytest.raises(ValueError, match="64 features, the weight 32"):
        mxfp8_linear(x, elements[:, :32].contiguous(), scales[:, :1].contiguous())


def test_the_layer_runs_the_gemm_on_triton_devices(monkeypatch):
    """A fused mxfp8 layer on a device type the GEMM serves (here the CPU, interpreted)
    calls it and gives the CPU path's result."""
    calls = []

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return mxfp8_linear(*args, **kwargs)

    gen = torch.Generator().manual_seed(13)
    layer = MergedLinear(64, [32, 16, 16], True, torch.float32)
    layer.set_method(Mxfp8Quantizer.from_config({}, prequantized=False).get_linear_method("model.layers.0.qkv_proj"))
    for shard, rows in enumerate((32, 16, 16)):
        layer.load_checkpoint_tensor("weight", shard, torch.randn(rows, 64, generator=gen))
        layer.load_checkpoint_tensor("bias", shard, torch.randn(rows, generator=gen))
    layer.method.process_weights_after_loading(layer)
    x = torch.randn(3, 64, generator=gen)
    with torch.no_grad():
        cpu_path = layer(x)
        monkeypatch.setattr(quantizer_module, "TRITON_DEVICE_TYPES", ("cpu",))
        monkeypatch.setattr("engine_xpu.mxfp8_gemm.mxfp8_linear", spy)
        triton_path = layer(x)
    assert calls == [(3, 64)]
    torch.testing.assert_close(triton_path, cpu_path, rtol=1e-5, atol=1e-5)
