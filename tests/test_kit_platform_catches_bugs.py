"""PlatformTests fails a broken platform: each deliberately broken variant below is
caught by the kit check named next to it, and the CPU platform passes them all."""

from __future__ import annotations

import sys
from pathlib import Path

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))
from plugin_helpers import run_kit_in_subprocess  # noqa: E402

pytest_plugins = ["pytester"]

PLUGIN = """
import dataclasses

import engine
from engine.interfaces.platform import Availability
from engine_cpu.attention import CpuPagedAttention
from engine_cpu.platform import CpuPlatform

NAMES = ("good_cpu", "silent", "bad_dtype", "ghost_pref", "dirty_cache", "frozen_stats")


class Backend(CpuPagedAttention):
    name = "for_test_platforms"
    capabilities = dataclasses.replace(CpuPagedAttention.capabilities, platforms=frozenset(NAMES))


class Good(CpuPlatform):
    name = "good_cpu"
    attention_backends = {"mha": ("for_test_platforms",), "sliding_window": ("for_test_platforms",)}


class SilentProbe(Good):
    name = "silent"

    @classmethod
    def is_available(cls):
        return Availability(True, "")


class ClaimsHalfButBreaksIt(Good):
    name = "bad_dtype"
    supported_dtypes = ("float32", "bfloat16", "complex64x")


class PrefersAGhost(Good):
    name = "ghost_pref"
    attention_backends = {"mha": ("no_such_backend",)}


class DirtyCache(Good):
    name = "dirty_cache"

    def allocate_kv_cache(self, shape, dtype):
        import torch
        return torch.ones(shape, dtype=dtype)


class FrozenStats(Good):
    # claims allocator counters that never move

    name = "frozen_stats"

    def memory_stats(self):
        return (1 << 20, 1 << 20)


@engine.hookimpl
def register_platforms(register):
    for cls in (Good, SilentProbe, ClaimsHalfButBreaksIt, PrefersAGhost, DirtyCache, FrozenStats):
        register(cls)


@engine.hookimpl
def register_attention_backends(register):
    register(Backend)
"""

TESTS = """
from engine.testing.kit import PlatformTests

class TestGood(PlatformTests):
    plugin = "broken_platforms"
    platform_name = "good_cpu"

class TestSilent(PlatformTests):
    plugin = "broken_platforms"
    platform_name = "silent"

class TestBadDtype(PlatformTests):
    plugin = "broken_platforms"
    platform_name = "bad_dtype"

class TestGhostPref(PlatformTests):
    plugin = "broken_platforms"
    platform_name = "ghost_pref"

class TestDirtyCache(PlatformTests):
    plugin = "broken_platforms"
    platform_name = "dirty_cache"

class TestFrozenStats(PlatformTests):
    plugin = "broken_platforms"
    platform_name = "frozen_stats"
"""

# broken variant -> the kit check that must fail for it
CAUGHT_BY = {
    "TestSilent": "test_availability_answers_with_a_reason",
    "TestBadDtype": "test_declared_dtypes_work",
    "TestGhostPref": "test_backend_preferences_resolve_to_registered_backends",
    "TestDirtyCache": "test_kv_cache_allocation",
    "TestFrozenStats": "test_memory_stats_count_what_is_allocated",
}


def test_every_broken_platform_is_caught_by_its_check_and_only_there(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(pytester.path))
    outcomes = run_kit_in_subprocess(pytester, broken_platforms=PLUGIN, test_platform_kit=TESTS)
    for cls, check in CAUGHT_BY.items():
        assert outcomes[(cls, check)] == "failed", f"{cls}: {check} did not fail"
    good = {check: outcome for (cls, check), outcome in outcomes.items() if cls == "TestGood"}
    assert len(good) == 7 and set(good.values()) == {"passed"}, good
    for (cls, check), outcome in outcomes.items():
        if cls in CAUGHT_BY and check != CAUGHT_BY[cls]:
            assert outcome == "passed", (cls, check, outcome)
