"""Core layers against the HF transformers modules they reimplement."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from engine.layers.layernorm import RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_hf(dtype):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(257, 96, generator=gen) * 3).to(dtype)
    weight = torch.randn(96, generator=gen).to(dtype)
    ours, theirs = RMSNorm(96, eps=1e-5, dtype=dtype), LlamaRMSNorm(96, eps=1e-5).to(dtype)
    ours.weight.data.copy_(weight)
    theirs.weight.data.copy_(weight)
    with torch.no_grad():
        assert torch.equal(ours(x), theirs(x))
        # per-head norms (Qwen3 q/k norm) normalise the last dim of a 3-d tensor
        assert torch.equal(ours(x.view(257, 1, 96)), theirs(x.view(257, 1, 96)))


@pytest.mark.parametrize(
    "parameters",
    [
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "beta_fast": 32,
            "beta_slow": 1,
            "original_max_position_embeddings": 64,
        },
        {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0, "original_max_position_embeddings": 128},
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 2.0,
            "original_max_position_embeddings": 128,
            "truncate": False,
        },
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
    ids=["yarn-mscale", "yarn-plain", "yarn-untruncated", "llama3"],
)
def test_rope_frequencies_equal_transformers(parameters):
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from engine.layers.rotary import inverse_frequencies

    config = DeepseekV3Config(
        hidden_size=64,
        num_attention_heads=4,
        qk_rope_head_dim=16,
        max_position_embeddings=512,
        rope_parameters=dict(parameters),
    )
    expected, expected_scaling = ROPE_INIT_FUNCTIONS[parameters["rope_type"]](config, "cpu")
    ours, scaling = inverse_frequencies(16, dict(config.rope_parameters), 512)
    assert torch.allclose(ours, expected, rtol=1e-6, atol=0) and scaling == pytest.approx(expected_scaling)


@pytest.mark.parametrize("bias", [False, True])
def test_gated_mlp_over_many_rows_equals_the_plain_formula(bias):
    """A prefill longer than MLP_ROWS runs in row chunks; every row is what
    down(silu(gate(x)) * up(x)) gives it, the last, shorter chunk included."""
    import torch.nn.functional as F

    from engine.interfaces.forward_context import ForwardContext
    from engine.layers.decoder import MLP_ROWS, GatedMLP

    torch.manual_seed(0)
    mlp = GatedMLP(64, 96, bias, torch.float32)
    for parameter in mlp.parameters():
        parameter.data.normal_(0, 0.1)
    x = torch.randn(2 * MLP_ROWS + 37, 64)
    ctx = ForwardContext(backends=[], kv_caches=[], metadata=[])

    gate_up = F.linear(x, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.linear(F.silu(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)
    torch.testing.assert_close(mlp(x, ctx), expected, rtol=1e-5, atol=1e-6)
