"""``PlatformTests``: what the engine relies on from a platform, checked on it."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from engine.testing.kit.base import KitTests, capability_skip


class PlatformTests(KitTests):
    """Subclass with ``plugin`` (the providing plugin) and ``platform_name`` (its
    registered name). Checks that need the platform's device skip when
    ``is_available()`` says no, with its reason."""

    registry_name = "platforms"
    platform_name: ClassVar[str | None] = None

    def platform_class(self) -> Any:
        return self.resolve(self.required("platform_name"))

    def available_platform(self) -> Any:
        cls = self.platform_class()
        availability = cls.is_available()
        if not availability:
            pytest.skip(f"platform {cls.name} is not available here: {availability.reason}")
        return cls()

    def test_discoverable(self) -> None:
        """The plugin registers the platform under its declared name, as an engine Platform."""
        from engine.interfaces.platform import Platform

        cls = self.platform_class()
        assert issubclass(cls, Platform)
        assert cls.name == self.platform_name

    def test_availability_answers_with_a_reason(self) -> None:
        """``is_available()`` never raises and always says why."""
        availability = self.platform_class().is_available()
        assert isinstance(availability.available, bool)
        assert isinstance(availability.reason, str) and availability.reason.strip()

    def test_declared_dtypes_work(self) -> None:
        """Every declared dtype can hold values on the device and multiply matrices correctly."""
        import torch

        platform = self.available_platform()
        assert platform.supported_dtypes, "a platform must declare at least one dtype"
        for name in platform.supported_dtypes:
            dtype = getattr(torch, name)
            a = torch.arange(16, dtype=torch.float32).reshape(4, 4)
            expected = a @ a.T
            got = (a.to(platform.device(), dtype) @ a.to(platform.device(), dtype).T).float().cpu()
            torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2, msg=f"matmul in {name}")

    def test_backend_preferences_resolve_to_registered_backends(self) -> None:
        """Each backend the platform prefers for a kind is registered (by some loaded plugin)
        and declares that kind and this platform."""
        platform = self.platform_class()()
        preferences = getattr(type(platform), "attention_backends", {}) or {}
        if not preferences:
            capability_skip("attention backend preferences")
        components = self.components()
        for kind in preferences:
            for name in platform.attention_backend_preferences(kind):
                backend = components.attention_backends.get(name)
                assert kind in backend.capabilities.kinds, f"{name} does not declare kind {kind}"
                assert platform.name in backend.capabilities.platforms, f"{name} does not declare {platform.name}"

    def test_memory_info_is_plausible(self) -> None:
        """Free memory is positive and at most the total."""
        info = self.available_platform().memory_info()
        assert 0 < info.free_bytes <= info.total_bytes

    def test_memory_stats_count_what_is_allocated(self) -> None:
        """Where ``memory_stats`` answers: a tensor allocated after ``reset_peak_memory`` raises
        the live bytes by at least its size, and the peak is never below the live bytes."""
        import torch

        platform = self.available_platform()
        if platform.memory_stats() is None:
            capability_skip("memory_stats")
        platform.synchronize()
        platform.reset_peak_memory()
        before, _ = platform.memory_stats()
        held = torch.empty(4 << 20, dtype=torch.uint8, device=platform.device())
        platform.synchronize()
        allocated, peak = platform.memory_stats()
        assert allocated - before >= held.numel(), f"allocated rose by {allocated - before} bytes for {held.numel()}"
        assert peak >= allocated, f"peak {peak} below the live bytes {allocated}"
        del held

    def test_seeding_makes_sampling_reproducible(self) -> None:
        """``seed_everything`` fixes torch's random streams on the device."""
        import torch

        platform = self.available_platform()
        platform.seed_everything(1234)
        first = torch.rand(8, device=platform.device()).cpu()
        platform.seed_everything(1234)
        assert torch.equal(first, torch.rand(8, device=platform.device()).cpu())

    def test_kv_cache_allocation(self) -> None:
        """``allocate_kv_cache`` gives a zero-filled contiguous tensor of the shape and dtype asked, on the device."""
        import torch

        platform = self.available_platform()
        dtype = getattr(torch, platform.supported_dtypes[0])
        cache = platform.allocate_kv_cache((2, 3, 16, 2, 8), dtype)
        assert cache.shape == (2, 3, 16, 2, 8) and cache.dtype == dtype and cache.is_contiguous()
        assert cache.device.type == platform.device().type
        assert not cache.any()
