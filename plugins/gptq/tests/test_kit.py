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
