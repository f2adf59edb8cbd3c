"""engine-xpu through the conformance kit (engine.testing.kit): the platform (unavailable
without an Intel GPU, so its device checks skip with the reason) and the mxfp8 quantizer
(checked on the CPU, where its layers dequantize and call F.linear)."""

from __future__ import annotations

from engine.testing.kit import PlatformTests, QuantizerTests


class TestXpuPlatformKit(PlatformTests):
    plugin = "xpu"
    platform_name = "xpu"


class TestMxfp8Kit(QuantizerTests):
    plugin = "xpu"
    also_load = ("cpu",)
    quantizer_name = "mxfp8"
    configs = {"default": {}, "skipping-other-modules": {"modules_to_not_convert": ["vision_tower", "mlp.experts"]}}
