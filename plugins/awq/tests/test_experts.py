"""AWQ mixtures of experts: a tiny Qwen3-MoE whose routed experts are AWQ GEMM modules
(``mlp.experts.<e>.<proj>.qweight`` / ``qzeros`` / ``scales``, as AutoAWQ writes them), run from
their packed weights, against the model dequantized by awq_reference.py
(``engine.testing.quantized_experts``)."""

from __future__ import annotations

import torch
from awq_reference import dequantize

from engine.testing.quantized_experts import QuantizedExpertsTests
from engine_awq.quantizer import AwqQuantizer

# groups of 32: the experts' down projections have 32 inputs
CONFIG = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}


class TestAwqExperts(QuantizedExpertsTests):
    plugins = ["cpu", "llama", "awq"]
    quantization = "awq"
    quantization_config = CONFIG

    @classmethod
    def export(cls, weight):
        return AwqQuantizer.from_config(CONFIG, prequantized=False).export_weight(weight, None)

    @classmethod
    def dequantize(cls, tensors):
        return torch.from_numpy(dequantize({k: v.numpy() for k, v in tensors.items()}, CONFIG["group_size"]))
