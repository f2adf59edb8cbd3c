"""engine-rocm through the plugin conformance kit (engine.testing.kit). Without an AMD GPU
the device checks skip with the platform's reason."""

from __future__ import annotations

from engine.testing.kit import PlatformTests


class TestRocmPlatformKit(PlatformTests):
    plugin = "rocm"
    platform_name = "rocm"
