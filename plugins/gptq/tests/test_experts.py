"""GPTQ mixtures of experts: a tiny Qwen3-MoE whose routed experts are GPTQ modules
(``mlp.experts.<e>.<proj>.qweight`` / ``qzeros`` / ``scales`` / ``g_idx``, as GPTQModel writes
them), run from their packed weights, against the model dequantized by gptq_reference.py
(``engine.testing.quantized_experts``)."""

from __future__ import annotations

import pytest
import torch
from gptq_reference import dequantize

from engine.testing import quantized_experts as moe
from engine_gptq.quantizer import GptqQuantizer

PLUGINS = ["cpu", "llama", "gptq"]
SETTINGS = {"bits": 4, "group_size": 32, "sym": False, "desc_act": True, "checkpoint_format": "gptq"}
# fp32: the order of the float32 sums; bf16: the dense reference rounds its weights to bf16, and
# the routed experts carry it on (measured up to 3.2e-2)
TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    quantizer = GptqQuantizer.from_config(SETTINGS, prequantized=False)
    return moe.moe_checkpoints(
        tmp_path_factory.mktemp("gptq-moe"),
        {"quant_method": "gptq", **SETTINGS},
        lambda weight: quantizer.export_weight(weight, None),
        lambda tensors: torch.from_numpy(dequantize({k: v.numpy() for k, v in tensors.items()}, SETTINGS["bits"])),
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gptq_experts_run_from_their_packed_weights(checkpoints, dtype):
    llm = moe.check_experts_match_dequantized(checkpoints, PLUGINS, dtype, TOLERANCE[dtype])
    experts = llm.engine.model.model.layers[0].mlp.experts
    assert all(part.input_order is not None for part in experts.gate_up[0])  # act-order over 2 groups


def test_quantizing_experts_while_loading_matches_the_checkpoint(checkpoints):
    moe.check_quantizing_while_loading_matches(checkpoints, PLUGINS, "gptq", SETTINGS)


def test_quantized_experts_without_a_method_or_a_projection_are_refused_by_name(checkpoints, tmp_path):
    moe.check_load_errors(checkpoints, PLUGINS, tmp_path)
