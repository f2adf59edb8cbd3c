"""engine-cuda through the plugin conformance kit (engine.testing.kit). Without an NVIDIA GPU
the device checks skip with the platform's reason."""

from __future__ import annotations

from engine.testing.kit import PlatformTests


class TestCudaPlatformKit(PlatformTests):
    plugin = "cuda"
    platform_name = "cuda"
