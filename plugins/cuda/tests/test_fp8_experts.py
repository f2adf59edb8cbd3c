"""FP8 mixtures of experts: a tiny Qwen3-MoE whose projections (routed experts' too) are
e4m3 in blocks with float32 factors (DeepSeek's ``weight_scale_inv``, as transformers' FP8
checkpoints hold them), and a compressed-tensors ``float-quantized`` one with a factor per
channel. The routed experts stay e4m3 (``Fp8Weight``, computed by the platform's
``fp8_linear``) and the logits match the model whose every weight is the format's value
written out plainly (each byte's value times its block's factor), loaded unquantized
(``engine.testing.quantized_experts``)."""

from __future__ import annotations

import itertools

import pytest
import torch

from engine.interfaces.fp8 import Fp8Weight
from engine.testing.quantized_experts import (
    QuantizedExpertsTests,
    check_experts_match_dequantized,
    moe_checkpoints,
)
from engine_cuda.fp8 import Fp8ExpertsMethod, Fp8Quantizer

BLOCK = (16, 16)  # the tiny model's projections span several blocks each way
CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}
E4M3_MAX = 448.0


def e4m3_value(byte: int) -> float:
    """An e4m3fn byte's value from its fields (sign, 4-bit exponent of bias 7, 3-bit mantissa)."""
    sign = -1.0 if byte & 0x80 else 1.0
    exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return float("nan")
    if exponent == 0:
        return sign * (mantissa / 8) * 2.0**-6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


E4M3_TABLE = torch.tensor([e4m3_value(b) for b in range(256)], dtype=torch.float64)


def blocks_reference(weight: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Each byte's value times the factor of the block holding it."""
    values = E4M3_TABLE[weight.view(torch.uint8).long()]
    out = torch.empty(weight.shape, dtype=torch.float64)
    rows, cols = weight.shape
    for i, j in itertools.product(range(0, rows, block[0]), range(0, cols, block[1])):
        out[i : i + block[0], j : j + block[1]] = values[i : i + block[0], j : j + block[1]] * float(
            scales[i // block[0], j // block[1]]
        )
    return out


class TestFp8Experts(QuantizedExpertsTests):
    plugins = ["cpu", "llama", "cuda"]
    quantization = "fp8"
    quantization_config = CONFIG
    # a byte a weight and a float32 factor per row and 16 inputs: 1.25 of bf16's 2 bytes
    held_fraction = 0.65

    @classmethod
    def export(cls, weight):
        return Fp8Quantizer.from_config(CONFIG, prequantized=False).export_weight(weight, None)

    @classmethod
    def dequantize(cls, tensors):
        return blocks_reference(tensors["weight"], tensors["weight_scale_inv"], BLOCK)


PER_CHANNEL = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "config_groups": {
        "group_0": {
            "format": "float-quantized",
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
        }
    },
    "ignore": ["lm_head"],
}


def per_channel(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """compressed-tensors' channel strategy: each row divided by its largest magnitude / 448."""
    scale = weight.float().abs().amax(dim=1, keepdim=True) / E4M3_MAX
    return {"weight": (weight.float() / scale).to(torch.float8_e4m3fn), "weight_scale": scale}


def test_compressed_tensors_fp8_experts_per_channel_run_in_e4m3(tmp_path):
    checkpoints = moe_checkpoints(
        tmp_path,
        PER_CHANNEL,
        per_channel,
        lambda t: blocks_reference(t["weight"], t["weight_scale"], (1, t["weight"].shape[1])),
    )
    llm = check_experts_match_dequantized(checkpoints, ["cpu", "llama", "cuda"], "float32", 1e-4, held_fraction=0.6)
    down = llm.engine.model.model.layers[0].mlp.experts.down[0]
    assert isinstance(down, Fp8Weight) and down.block_k == down.in_features  # one factor a row


def test_expert_weights_are_refused_by_name_when_they_do_not_fit():
    method = Fp8ExpertsMethod(BLOCK, prequantized=True)
    with pytest.raises(
        ValueError, match=r"experts\.0\.up_proj: the model expects \(32, 64\), the checkpoint has \(32, 48\)"
    ):
        method.expert_weight({"weight": torch.zeros(32, 48)}, 32, 64, "experts.0.up_proj")
    with pytest.raises(ValueError, match=r"experts\.0\.up_proj is torch\.bfloat16 with no scale, not float8_e4m3fn"):
        method.expert_weight({"weight": torch.zeros(32, 64, dtype=torch.bfloat16)}, 32, 64, "experts.0.up_proj")
    with pytest.raises(
        ValueError,
        match=r"FP8 experts take a weight and its scale \(weight_scale_inv or weight_scale\); the checkpoint gives \[.qweight.",
    ):
        method.expert_weight({"qweight": torch.zeros(1), "weight": torch.zeros(1)}, 32, 64, "experts.0.up_proj")


def test_gate_and_up_join_into_one_weight_only_in_the_same_blocks():
    gen = torch.Generator().manual_seed(0)
    method = Fp8ExpertsMethod(BLOCK, prequantized=False)
    gate, up = (method.expert_weight({"weight": torch.randn(40, 48, generator=gen)}, 40, 48, p) for p in "gu")
    joined = gate.joined(up)
    assert joined is not None and joined.out_features == 80
    torch.testing.assert_close(joined.dequantize(), torch.cat([gate.dequantize(), up.dequantize()]), rtol=0, atol=0)
    other = Fp8ExpertsMethod((16, 32), prequantized=False).expert_weight({"weight": torch.randn(40, 48)}, 40, 48, "u")
    assert gate.joined(other) is None
