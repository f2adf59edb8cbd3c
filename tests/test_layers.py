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
