"""AWQ mixtures of experts: a tiny Qwen3-MoE whose routed experts are AWQ GEMM modules
(``mlp.experts.<e>.<proj>.qweight`` / ``qzeros`` / ``scales``, as AutoAWQ writes them), run from
their packed weights, against the model dequantized by awq_reference.py
(``engine.testing.quantized_experts``)."""

from __future__ import annotations

import pytest
import torch
from awq_reference import dequantize

from engine.testing import quantized_experts as moe
from engine_awq.quantizer import AwqQuantizer

PLUGINS = ["cpu", "llama", "awq"]
# groups of 32: the experts' down projections have 32 inputs
CONFIG = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
# fp32: the order of the float32 sums; bf16: the dense reference rounds its weights to bf16, and
# the routed experts carry it on (measured up to 3.2e-2)
TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    quantizer = AwqQuantizer.from_config(CONFIG, prequantized=False)
    return moe.moe_checkpoints(
        tmp_path_factory.mktemp("awq-moe"),
        CONFIG,
        lambda weight: quantizer.export_weight(weight, None),
        lambda tensors: torch.from_numpy(dequantize({k: v.numpy() for k, v in tensors.items()}, CONFIG["group_size"])),
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_awq_experts_run_from_their_packed_weights(checkpoints, dtype):
    moe.check_experts_match_dequantized(checkpoints, PLUGINS, dtype, TOLERANCE[dtype])


def test_quantizing_experts_while_loading_matches_the_checkpoint(checkpoints):
    settings = {k: v for k, v in CONFIG.items() if k != "quant_method"}
    moe.check_quantizing_while_loading_matches(checkpoints, PLUGINS, "awq", settings)


def test_quantized_experts_without_a_method_or_a_projection_are_refused_by_name(checkpoints, tmp_path):
    moe.check_load_errors(checkpoints, PLUGINS, tmp_path)
