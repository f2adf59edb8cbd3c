"""GPTQ mixtures of experts: a tiny Qwen3-MoE whose routed experts are GPTQ modules
(``mlp.experts.<e>.<proj>.qweight`` / ``qzeros`` / ``scales`` / ``g_idx``, as GPTQModel writes
them), run from their packed weights, against the model dequantized by gptq_reference.py
(``engine.testing.quantized_experts``)."""

from __future__ import annotations

import torch
from gptq_reference import dequantize

from engine.testing.quantized_experts import QuantizedExpertsTests, check_experts_match_dequantized
from engine_gptq.quantizer import GptqQuantizer

SETTINGS = {"bits": 4, "group_size": 32, "sym": False, "desc_act": True, "checkpoint_format": "gptq"}


class TestGptqExperts(QuantizedExpertsTests):
    plugins = ["cpu", "llama", "gptq"]
    quantization = "gptq"
    quantization_config = {"quant_method": "gptq", **SETTINGS}

    @classmethod
    def export(cls, weight):
        return GptqQuantizer.from_config(SETTINGS, prequantized=False).export_weight(weight, None)

    @classmethod
    def dequantize(cls, tensors):
        return torch.from_numpy(dequantize({k: v.numpy() for k, v in tensors.items()}, SETTINGS["bits"]))

    def test_act_order_gives_each_part_its_input_order(self, checkpoints):
        llm = check_experts_match_dequantized(checkpoints, self.plugins, "float32", self.tolerance["float32"])
        experts = llm.engine.model.model.layers[0].mlp.experts
        assert all(part.input_order is not None for part in experts.gate_up[0])  # act-order over 2 groups
