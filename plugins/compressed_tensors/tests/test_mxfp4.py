"""compressed-tensors ``mxfp4-pack-quantized``: the conversion into the group-quantized layout
against the format written plainly (mxfp4_reference.py), the platform's kernel on it, a tiny
Qwen3-MoE with MXFP4 linear layers and experts (``engine.testing.quantized_experts``), the kit's
quantizer checks, and the errors for tensors that do not fit."""

from __future__ import annotations

import pytest
import torch
from mxfp4_reference import dequantize_reference

from engine.interfaces.group_quant import group_quant_linear
from engine.testing.kit import QuantizerTests
from engine.testing.quantized_experts import QuantizedExpertsTests
from engine_compressed_tensors.mxfp4 import Mxfp4Quantizer, quantize, to_group_quant

CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "targets": ["Linear"]}},
    "ignore": ["lm_head"],
}


def random_mxfp4(rows: int, cols: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    packed = torch.randint(0, 256, (rows, cols // 2), generator=gen, dtype=torch.uint8)
    scale = torch.randint(100, 140, (rows, cols // 32), generator=gen, dtype=torch.uint8)
    scale[0, 0], scale[-1, -1] = 0, 200  # the smallest factor (subnormal products), a large one
    return packed, scale


@pytest.mark.parametrize(("rows", "cols", "storage"), [(48, 256, 6), (40, 96, 8)])
def test_conversion_is_the_formats_values_exactly(rows, cols, storage):
    gen = torch.Generator().manual_seed(rows)
    packed, scale = random_mxfp4(rows, cols, gen)
    weight = to_group_quant(packed, scale, rows, cols, "w")
    assert (weight.bits, weight.group_size, weight.zero, weight.offsets) == (storage, 32, 12, None)
    want = torch.from_numpy(dequantize_reference(packed.numpy(), scale.numpy()))
    assert torch.equal(weight.dequantize().double(), want)
    # the values in 6 (or 8) bits and a float32 scale per 32: 7/16 (9/16) of bfloat16's bytes
    held = sum(t.numel() * t.element_size() for t in (weight.qweight, weight.scales))
    assert held == rows * cols * (storage + 1) // 8


def test_platform_kernel_computes_the_converted_weight():
    from engine_cpu import native
    from engine_cpu.ops import NativeLayerOps

    kernels = native.load()
    if kernels is None:
        pytest.skip("engine-cpu's kernels are off (ENGINE_CPU_NATIVE=0) or could not be built")
    ops = NativeLayerOps(kernels)
    gen = torch.Generator().manual_seed(1)
    packed, scale = random_mxfp4(64, 256, gen)
    scale.clamp_(120, 130)  # products well inside float32's range
    weight = to_group_quant(packed, scale, 64, 256, "w")
    dense = torch.from_numpy(dequantize_reference(packed.numpy(), scale.numpy()))
    x = torch.randn(5, 256, generator=gen, dtype=torch.float64)
    want = x @ dense.T
    for got in (ops.group_quant_linear(x.float(), weight), group_quant_linear(x.float(), weight)):
        assert (got.double() - want).abs().max() <= 1e-5 * (x.abs() @ dense.abs().T).max()


def test_rounding_a_dense_weight_gives_the_nearest_format_values():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(16, 64, generator=gen) * 3
    packed, scale = quantize(w)
    got = torch.from_numpy(dequantize_reference(packed.numpy(), scale.numpy()))
    for n in range(16):
        for j in range(2):
            group = w[n, 32 * j : 32 * (j + 1)].double()
            factor = 2.0 ** (int(scale[n, j]) - 127)
            assert group.abs().max() / factor <= 6 < group.abs().max() / factor * 2  # the smallest such power
            grid = torch.tensor([s * m for s in (1, -1) for m in (0, 0.5, 1, 1.5, 2, 3, 4, 6)], dtype=torch.float64)
            nearest = (group[:, None] / factor - grid).abs().min(dim=1).values
            assert torch.allclose((got[n, 32 * j : 32 * (j + 1)] / factor - group / factor).abs(), nearest)


def test_tensors_that_do_not_fit_are_refused_by_name():
    gen = torch.Generator().manual_seed(3)
    packed, scale = random_mxfp4(8, 64, gen)
    with pytest.raises(ValueError, match=r"proj's mxfp4-pack-quantized weight_scale is \(8, 3\)"):
        to_group_quant(packed, torch.zeros(8, 3, dtype=torch.uint8), 8, 64, "proj")
    with pytest.raises(ValueError, match=r"weight_packed is \(8, 32\) torch.uint8; a module of 96 inputs"):
        to_group_quant(packed, scale, 8, 96, "proj")
    scale[3, 1] = 255
    with pytest.raises(ValueError, match="proj's weight_scale: an MXFP4 exponent is 255 .NaN"):
        to_group_quant(packed, scale, 8, 64, "proj")
    with pytest.raises(ValueError, match="not served as mxfp4-pack-quantized: format pack-quantized"):
        Mxfp4Quantizer.from_config({**CONFIG, "format": "pack-quantized", "config_groups": {}}, prequantized=True)


class TestMxfp4Experts(QuantizedExpertsTests):
    plugins = ["cpu", "llama", "compressed_tensors"]
    quantization = "compressed-tensors/mxfp4-pack-quantized"
    quantization_config = CONFIG
    # the tiny model's experts have 64 and 32 inputs, not multiples of 128: their values take
    # 8 bits (9/16 of bf16's bytes with the scales; 7/16 in 6 bits at real models' sizes)
    held_fraction = 0.6

    @classmethod
    def export(cls, weight):
        return Mxfp4Quantizer.from_config(CONFIG, prequantized=False).export_weight(weight, None)

    @classmethod
    def dequantize(cls, tensors):
        return torch.from_numpy(dequantize_reference(tensors["weight_packed"].numpy(), tensors["weight_scale"].numpy()))


class TestMxfp4Kit(QuantizerTests):
    plugin = "compressed_tensors"
    quantizer_name = "compressed-tensors/mxfp4-pack-quantized"
    configs = {"mxfp4": CONFIG}
