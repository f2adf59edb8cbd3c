"""compressed-tensors mixtures of experts: a tiny Qwen3-MoE whose routed experts are
pack-quantized modules (``mlp.experts.<e>.<proj>.weight_packed`` / ``weight_scale`` /
``weight_zero_point`` / ``weight_shape``, as llm-compressor writes them), run from their packed
weights, against the model dequantized by the format's formula written plainly
(pack_quantized_reference.py; ``engine.testing.quantized_experts``)."""

from __future__ import annotations

import pytest
import torch
from pack_quantized_reference import config, dequantize_reference

from engine.testing import quantized_experts as moe
from engine_compressed_tensors.quantizer import PackQuantizedQuantizer

PLUGINS = ["cpu", "llama", "compressed_tensors"]
CONFIG = config(4, "group", False, 32)  # asymmetric: zero points packed too
# fp32: the order of the float32 sums; bf16: the dense reference rounds its weights to bf16, and
# the routed experts carry it on (measured up to 3.2e-2)
TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    quantizer = PackQuantizedQuantizer.from_config(CONFIG, prequantized=False)
    return moe.moe_checkpoints(
        tmp_path_factory.mktemp("ct-moe"),
        CONFIG,
        lambda weight: quantizer.export_weight(weight, None),
        lambda tensors: torch.from_numpy(dequantize_reference(tensors, 4)),
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pack_quantized_experts_run_from_their_packed_weights(checkpoints, dtype):
    moe.check_experts_match_dequantized(checkpoints, PLUGINS, dtype, TOLERANCE[dtype])


def test_quantizing_experts_while_loading_matches_the_checkpoint(checkpoints):
    # the scales take the model's dtype: bf16, as the checkpoint's were written from bf16 weights
    moe.check_quantizing_while_loading_matches(
        checkpoints, PLUGINS, "compressed-tensors/pack-quantized", CONFIG, dtype="bfloat16"
    )


def test_quantized_experts_without_a_method_or_a_projection_are_refused_by_name(checkpoints, tmp_path):
    moe.check_load_errors(checkpoints, PLUGINS, tmp_path)
