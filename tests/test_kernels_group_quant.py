"""The Triton group-quantized linear kernel (engine.kernels.group_quant) under the Triton
interpreter, and the GPU platforms' layer ops that run it.

The kernel and the torch reference (engine.interfaces.group_quant.group_quant_linear) are
compared with the exact value of sum_k x[t, k] (s q[n, k] - m) + bias[n], computed in float64
from the integers, scales and offsets as the layout's formula says. Float32 sums may differ
from it by a few float32 epsilons of the size of the terms, ``|x| @ (|s q| + |m|)^T``; 16-bit
outputs by that plus one rounding to their dtype.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined: run them on the CPU

import dataclasses  # noqa: E402
import functools  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from engine.interfaces.group_quant import GroupQuantWeight, group_quant_linear  # noqa: E402
from engine.kernels.group_quant import TritonLayerOps, split_count, triton_group_quant_linear  # noqa: E402
from engine.plugins.manager import get_plugin_manager  # noqa: E402
from engine.selection import select_platform  # noqa: E402
from engine.testing.oracles import group_quant_exact, random_group_quant  # noqa: E402

K = 384  # 3 * 128: groups of 16, 32, 128 and K; 128 spans two K tiles of 64
N = 77  # odd: the last column tile is partial
FP32_EPSILONS = 6.0  # of the terms' size: the float32 tolerance
HALF_STEP = {torch.float32: 0.0, torch.bfloat16: 2**-8, torch.float16: 2**-11}  # one rounding, relative


# (value bits, two-level scales, symmetric): 4 and 8 bits with float32 scales; 4 and 6 bits with
# int8 codes per group and float32 per super-block (the GGUF k-quants); symmetric ones (a zero)
LAYOUTS = [(4, False, False), (8, False, False), (4, True, False), (6, True, False), (8, False, True), (6, True, True)]


random_weight = functools.partial(random_group_quant, N, K)  # (bits, group_size, gen, **layout)


def assert_within_rounding(out: torch.Tensor, x: torch.Tensor, w: GroupQuantWeight, bias: torch.Tensor | None):
    exact, size = group_quant_exact(x, w, bias)
    half_step = HALF_STEP[out.dtype]
    bound = FP32_EPSILONS * torch.finfo(torch.float32).eps * size * (1 + half_step) + half_step * exact.abs()
    worst = ((out.double() - exact).abs() / bound).max().item()
    assert worst <= 1.0, f"error {worst:.2f} times the tolerance ({out.dtype}, {tuple(out.shape)})"


@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("group_size", [16, 32, 128, K])
@pytest.mark.parametrize(("bits", "two_level", "symmetric"), LAYOUTS)
def test_kernel_matches_the_layout_and_the_reference(bits, two_level, symmetric, group_size, rows):
    gen = torch.Generator().manual_seed(bits * 1000 + group_size * 10 + rows)
    w = random_weight(bits, group_size, gen, two_level=two_level, symmetric=symmetric)
    assert (w.zero is not None) == symmetric
    x = torch.randn(rows, K, generator=gen)
    bias = torch.randn(N, generator=gen) if rows != 5 else None
    out = triton_group_quant_linear(x, w, bias)
    assert out.shape == (rows, N) and out.dtype == torch.float32
    assert_within_rounding(out, x, w, bias)
    assert_within_rounding(group_quant_linear(x, w, bias), x, w, bias)  # the tolerance holds the reference too


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 64])
@pytest.mark.parametrize(("bits", "two_level", "symmetric"), LAYOUTS)
def test_16_bit_activations(bits, two_level, symmetric, rows, dtype):
    """bf16 / fp16 x and bias: float32 sums of the exact products, rounded once to x's dtype,
    as the reference does (the two differ only next to a tie)."""
    gen = torch.Generator().manual_seed(bits * 100 + rows)
    w = random_weight(bits, 32, gen, two_level=two_level, symmetric=symmetric)
    x = torch.randn(rows, K, generator=gen).to(dtype)
    bias = torch.randn(N, generator=gen).to(dtype)
    out = triton_group_quant_linear(x, w, bias)
    assert out.dtype == dtype
    assert_within_rounding(out, x, w, bias)
    reference = group_quant_linear(x, w, bias)
    assert (out != reference).float().mean().item() < 0.02


@pytest.mark.parametrize(("bits", "two_level", "symmetric"), LAYOUTS)
def test_input_order(bits, two_level, symmetric):
    """With an input order, input k of the weight multiplies x[:, input_order[k]]."""
    gen = torch.Generator().manual_seed(7 + bits)
    w = random_weight(bits, 32, gen, ordered=True, two_level=two_level, symmetric=symmetric)
    x = torch.randn(5, K, generator=gen)
    bias = torch.randn(N, generator=gen)
    out = triton_group_quant_linear(x, w, bias)
    assert_within_rounding(out, x, w, bias)
    unordered = dataclasses.replace(w, input_order=None)
    assert (triton_group_quant_linear(x, unordered, bias) - out).abs().max() > 0.1  # the order matters here


@pytest.mark.parametrize("split", [1, 2, 4, 6])
def test_split_k_gives_the_same_sums(split):
    """Decode rows split K among programs (K / 64 = 6 tiles here: 2 and 4 splits leave the last
    split short), each adding its own scales' and offsets' terms; the bias is added once."""
    gen = torch.Generator().manual_seed(split)
    w = random_weight(4, 128, gen)
    x = torch.randn(3, K, generator=gen)
    bias = torch.randn(N, generator=gen)
    out = triton_group_quant_linear(x, w, bias, split=split)
    assert_within_rounding(out, x, w, bias)


def test_decode_splits_k_and_prefill_does_not():
    assert split_count(rows=1, column_tiles=2, k_tiles=6) == 6
    assert split_count(rows=16, column_tiles=64, k_tiles=64) == 4
    assert split_count(rows=17, column_tiles=2, k_tiles=64) == 1


def test_leading_dimensions_and_empty_input():
    gen = torch.Generator().manual_seed(3)
    w = random_weight(4, 32, gen)
    x = torch.randn(2, 3, K, generator=gen)
    out = triton_group_quant_linear(x, w)
    assert out.shape == (2, 3, N)
    assert_within_rounding(out.view(6, N), x.view(6, K), w, None)
    assert triton_group_quant_linear(torch.empty(0, K), w).shape == (0, N)


def test_group_sizes_without_a_k_tile_go_to_the_reference():
    """Groups of 24 inputs hold no K tile of 16 or more: the kernel refuses them and the
    layer ops give the reference's values."""
    gen = torch.Generator().manual_seed(5)
    w = random_weight(4, 24, gen)
    x = torch.randn(4, K, generator=gen)
    with pytest.raises(ValueError, match="group size 24"):
        triton_group_quant_linear(x, w)
    assert torch.equal(TritonLayerOps().group_quant_linear(x, w), group_quant_linear(x, w))
    with pytest.raises(ValueError, match="x has 100 inputs"):
        triton_group_quant_linear(torch.randn(4, 100), random_weight(4, 32, gen))


def test_layer_ops_run_the_kernel():
    gen = torch.Generator().manual_seed(11)
    w = random_weight(8, 16, gen, ordered=True)
    x = torch.randn(5, K, generator=gen)
    bias = torch.randn(N, generator=gen)
    out = TritonLayerOps().group_quant_linear(x, w, bias)
    assert torch.equal(out, triton_group_quant_linear(x, w, bias))
    assert_within_rounding(out, x, w, bias)


# the GPU platforms, with their device probes faked (as their plugins' tests fake them)


@dataclass
class FakeDeviceProperties:
    name: str
    gcnArchName: str


def fake_cuda(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA H100 80GB HBM3")


def fake_rocm(monkeypatch):
    for variable in ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(torch.version, "hip", "6.3.42131")
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    properties = FakeDeviceProperties("AMD Instinct MI300X", "gfx942:sramecc+:xnack-")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=0: properties)


def fake_xpu(monkeypatch):
    monkeypatch.setattr(torch.xpu, "is_available", lambda: True)
    monkeypatch.setattr(torch.xpu, "device_count", lambda: 1)
    monkeypatch.setattr(torch.xpu, "get_device_name", lambda index=0: "Intel(R) Data Center GPU Max 1550")


GPU_PLATFORMS = {"cuda": fake_cuda, "rocm": fake_rocm, "xpu": fake_xpu}


def selected_platform(name: str, monkeypatch):
    GPU_PLATFORMS[name](monkeypatch)
    return select_platform(get_plugin_manager([name]).components().platforms, name)


@pytest.mark.parametrize("name", sorted(GPU_PLATFORMS))
def test_gpu_platforms_give_the_triton_layer_ops(name, monkeypatch):
    platform = selected_platform(name, monkeypatch)
    for dtype in ("bfloat16", "float16", "float32"):
        assert isinstance(platform.layer_ops(dtype), TritonLayerOps), f"{name} layer_ops({dtype!r})"


@pytest.mark.parametrize("name", sorted(GPU_PLATFORMS))
def test_gpu_platforms_keep_the_reference_without_triton(name, monkeypatch):
    platform = selected_platform(name, monkeypatch)
    monkeypatch.setitem(sys.modules, "triton", None)  # what importing it finds where it is not installed
    assert platform.layer_ops("bfloat16") is None
