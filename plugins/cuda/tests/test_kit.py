"""engine-cuda through the plugin conformance kit (engine.testing.kit). Without an NVIDIA GPU
the device checks skip with the platform's reason."""

from __future__ import annotations

from engine.testing.kit import PlatformTests, QuantizerTests


class TestCudaPlatformKit(PlatformTests):
    plugin = "cuda"
    platform_name = "cuda"


class TestFp8QuantizerKit(QuantizerTests):
    """On the CPU the layers compute the dequantized product, the reference the GPU paths
    (plugins/cuda/tests/test_fp8_linear.py) are held to."""

    plugin = "cuda"
    quantizer_name = "fp8"
    configs = {"blocks 128x128": {"weight_block_size": [128, 128]}, "blocks 64x32": {"weight_block_size": [64, 32]}}
