"""engine-gptq through the conformance kit: 4 and 8 bits, groups of 32 / 128 / one per row,
act-order on and off, symmetric and asymmetric zeros, both checkpoint formats."""

from engine.testing.kit import QuantizerTests


class TestGptq(QuantizerTests):
    plugin = "gptq"
    quantizer_name = "gptq"
    configs = {
        "4bit-g128-sym": {"bits": 4, "group_size": 128, "sym": True},
        "4bit-g32-asym-actorder": {"bits": 4, "group_size": 32, "sym": False, "desc_act": True},
        "4bit-per-row-asym-v2": {"bits": 4, "group_size": -1, "sym": False, "checkpoint_format": "gptq_v2"},
        "8bit-g128-asym": {"bits": 8, "group_size": 128, "sym": False},
        "8bit-g32-sym-actorder-v2": {"bits": 8, "group_size": 32, "desc_act": True, "checkpoint_format": "gptq_v2"},
        "8bit-per-row-sym-actorder": {"bits": 8, "group_size": -1, "desc_act": True},
    }


def test_the_experts_check_catches_broken_experts(monkeypatch):
    """The kit's experts check fails an experts method that drops the zero points (offsets), and
    one whose prequantized experts load other weights than quantizing while loading gives."""
    import dataclasses

    import pytest
    import torch

    from engine.interfaces.quantizer import FormatExpertsMethod

    good = FormatExpertsMethod.expert_weight

    def without_offsets(self, tensors, out_features, in_features, what):
        weight = good(self, tensors, out_features, in_features, what)
        weight = weight.one_level()  # explicit offsets, also where they were a zero
        return dataclasses.replace(weight, offsets=torch.zeros_like(weight.offsets))

    monkeypatch.setattr(FormatExpertsMethod, "expert_weight", without_offsets)
    with pytest.raises(AssertionError, match="relative error"):
        TestGptq().test_quantized_experts_within_the_error_bound()

    def scales_halved_when_prequantized(self, tensors, out_features, in_features, what):
        weight = good(self, tensors, out_features, in_features, what)
        return weight if set(tensors) == {"weight"} else dataclasses.replace(weight, scales=weight.scales / 2)

    monkeypatch.setattr(FormatExpertsMethod, "expert_weight", scales_halved_when_prequantized)
    with pytest.raises(AssertionError, match="loaded from exported tensors differ"):
        TestGptq().test_quantized_experts_within_the_error_bound()
