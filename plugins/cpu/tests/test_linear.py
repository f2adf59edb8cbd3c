"""The oneDNN linear method against F.linear, and its use by the CPU platform."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import MergedLinear, UnquantizedLinearMethod, VocabEmbedding, apply_linear_method
from engine_cpu.linear import OneDNNLinearMethod, onednn_available
from engine_cpu.platform import CpuPlatform

pytestmark = pytest.mark.skipif(not onednn_available(), reason="torch was built without oneDNN")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_packed_linear_equals_f_linear(bias, rows):
    gen = torch.Generator().manual_seed(rows)
    layer = MergedLinear(48, [32, 16, 16], bias, torch.bfloat16)
    layer.weight.data.copy_(torch.randn(64, 48, generator=gen))
    if bias:
        layer.bias.data.copy_(torch.randn(64, generator=gen))
    x = torch.randn(rows, 48, generator=gen).bfloat16()
    expected = F.linear(x, layer.weight, layer.bias)
    assert apply_linear_method(layer, OneDNNLinearMethod()) == 1
    assert torch.equal(layer(x), expected)
    assert layer(x.view(1, rows, 48)).shape == (1, rows, 64)


def test_tied_embedding_keeps_its_plain_weight():
    model = nn.Module()
    model.embed = VocabEmbedding(100, 32, torch.bfloat16)
    model.embed.weight.data.normal_()
    model.lm_head = MergedLinear(32, [100], False, torch.bfloat16)
    model.lm_head.weight = model.embed.weight
    ids = torch.tensor([3, 7])
    before = model.embed(ids).clone()
    hidden = torch.randn(2, 32).bfloat16()
    logits = F.linear(hidden, model.embed.weight)
    apply_linear_method(model, OneDNNLinearMethod())
    assert torch.equal(model.embed(ids), before)
    assert torch.equal(model.lm_head(hidden), logits)


def test_platform_packs_bf16_only():
    platform = CpuPlatform()
    assert isinstance(platform.linear_method("bfloat16"), OneDNNLinearMethod)
    assert platform.linear_method("float32") is None


def test_layers_already_given_another_method_are_left_alone():
    class Other(UnquantizedLinearMethod):
        pass

    layer = MergedLinear(8, [8], False, torch.bfloat16, method=Other())
    assert apply_linear_method(layer, OneDNNLinearMethod()) == 0
    assert type(layer.method) is Other
