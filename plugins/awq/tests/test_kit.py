"""engine-awq through the conformance kit: groups of 128 / 32 / one per row, with zero
points and symmetric, the GEMM layout (as AutoAWQ spells it too) and the exllama version that
holds the same tensors."""

from engine.testing.kit import QuantizerTests


class TestAwq(QuantizerTests):
    plugin = "awq"
    quantizer_name = "awq"
    configs = {
        "g128-zero-point": {"bits": 4, "group_size": 128, "zero_point": True, "version": "GEMM"},
        "g32-symmetric": {"bits": 4, "group_size": 32, "zero_point": False},
        "per-row-zero-point-exllama": {"bits": 4, "group_size": -1, "version": "exllama"},
    }
