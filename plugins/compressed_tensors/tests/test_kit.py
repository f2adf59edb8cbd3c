"""engine-compressed-tensors through the conformance kit: 4-bit in groups of 128 and 32,
symmetric and with zero points, and 8-bit per channel, as the checkpoints' config_groups spell them."""

from engine.testing.kit import QuantizerTests


def pack_quantized(**weights) -> dict:
    scheme = {"type": "int", "symmetric": True, "dynamic": False, **weights}
    group = {"format": "pack-quantized", "targets": ["Linear"], "weights": scheme, "input_activations": None}
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
    }


class TestPackQuantized(QuantizerTests):
    plugin = "compressed_tensors"
    quantizer_name = "compressed-tensors/pack-quantized"
    configs = {
        "w4-g128-symmetric": pack_quantized(num_bits=4, strategy="group", group_size=128),
        "w4-g32-zero-points": pack_quantized(num_bits=4, strategy="group", group_size=32, symmetric=False),
        "w8-channel-symmetric": pack_quantized(num_bits=8, strategy="channel"),
        "w4-channel-zero-points": pack_quantized(num_bits=4, strategy="channel", symmetric=False),
    }
