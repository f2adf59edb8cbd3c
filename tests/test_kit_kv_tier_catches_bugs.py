"""KVTierTests fails a broken tier: each deliberately broken variant of the cpu tier
below is caught by the kit check named next to it, and the real cpu tier passes them all."""

from __future__ import annotations

import sys
from pathlib import Path

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))
from plugin_helpers import assert_broken_caught_and_good_passes, kit_subclasses, run_kit_in_subprocess  # noqa: E402

pytest_plugins = ["pytester"]

PLUGIN = '''
import engine
from engine.kv_tiers.cpu import CpuKVTier, done


class Good(CpuKVTier):
    name = "good"


class Liar(CpuKVTier):
    """lookup says every key is there"""
    name = "liar"

    def lookup(self, keys):
        super().lookup(keys)
        return len(keys)


class Zeros(CpuKVTier):
    """a load that succeeds hands back zeros"""
    name = "zeros"

    def load(self, keys, into):
        result = super().load(keys, into).result()
        for tensor in into:
            tensor.zero_()
        return done(result)


class Loser(CpuKVTier):
    """says every store succeeded but silently drops every other block"""
    name = "loser"

    def store(self, keys, blocks):
        super().store(keys[::2], blocks[::2])
        return done([True] * len(keys))


class NoCopy(CpuKVTier):
    """keeps the engine's tensor instead of a copy"""
    name = "no_copy"

    def store(self, keys, blocks):
        result = super().store(keys, blocks).result()
        for k, block in zip(keys, blocks):
            if k in self._blocks:
                self._blocks[k] = block.view(-1)
        return done(result)


class Hoarder(CpuKVTier):
    """never evicts"""
    name = "hoarder"

    def __init__(self, spec, config):
        super().__init__(spec, config)
        self.capacity_blocks = 10**9


class Undead(CpuKVTier):
    """keeps answering after close"""
    name = "undead"

    def close(self):
        pass


@engine.hookimpl
def register_kv_tiers(register):
    for cls in (Good, Liar, Zeros, Loser, NoCopy, Hoarder, Undead):
        register(cls)
'''

# broken variant -> the kit checks that must fail for it
CAUGHT_BY = {
    "liar": ("test_partial_load_and_lookup_of_leading_keys",),
    "zeros": ("test_byte_exact_round_trip[bfloat16]",),
    "loser": ("test_byte_exact_round_trip[float32]",),
    "no_copy": ("test_store_keeps_its_own_copy",),
    "hoarder": ("test_eviction_keeps_within_capacity",),
    "undead": ("test_closed_tier_refuses_calls",),
}

TESTS = kit_subclasses("KVTierTests", "broken_tiers", "tier_name", ["good", *CAUGHT_BY])


def test_every_broken_tier_is_caught_by_its_check(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(pytester.path))
    outcomes = run_kit_in_subprocess(pytester, broken_tiers=PLUGIN, test_tier_kit=TESTS)
    # every check but the persistence one (skipped: the cpu tier is not persistent) passes
    assert_broken_caught_and_good_passes(outcomes, CAUGHT_BY, good_checks=10)
