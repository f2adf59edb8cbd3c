"""compressed-tensors mixtures of experts: a tiny Qwen3-MoE whose routed experts are
pack-quantized modules (``mlp.experts.<e>.<proj>.weight_packed`` / ``weight_scale`` /
``weight_zero_point`` / ``weight_shape``, as llm-compressor writes them), run from their packed
weights, against the model dequantized by the format's formula written plainly
(pack_quantized_reference.py; ``engine.testing.quantized_experts``)."""

from __future__ import annotations

import torch
from pack_quantized_reference import config, dequantize_reference

from engine.testing.quantized_experts import QuantizedExpertsTests
from engine_compressed_tensors.quantizer import PackQuantizedQuantizer

CONFIG = config(4, "group", False, 32)  # asymmetric: zero points packed too


class TestPackQuantizedExperts(QuantizedExpertsTests):
    plugins = ["cpu", "llama", "compressed_tensors"]
    quantization = "compressed-tensors/pack-quantized"
    quantization_config = CONFIG
    # the scales take the model's dtype: bf16, as the checkpoint's were written from bf16 weights
    on_the_fly_dtype = "bfloat16"

    @classmethod
    def export(cls, weight):
        return PackQuantizedQuantizer.from_config(CONFIG, prequantized=False).export_weight(weight, None)

    @classmethod
    def dequantize(cls, tensors):
        return torch.from_numpy(dequantize_reference(tensors, 4))
