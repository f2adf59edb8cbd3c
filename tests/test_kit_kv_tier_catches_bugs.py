"""KVTierTests fails a broken tier: each deliberately broken variant of the cpu tier
below is caught by the kit check named next to it, and the real cpu tier passes them all,
named by its registered name and by its ``module.path:Class``."""

from __future__ import annotations

import sys
from pathlib import Path

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))
from plugin_helpers import assert_broken_caught_and_good_passes, kit_subclasses, run_kit_in_subprocess  # noqa: E402

pytest_plugins = ["pytester"]

PLUGIN = '''
from collections import OrderedDict

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


class NewestOut(OrderedDict):
    def popitem(self, last=True):
        return super().popitem(last=True)


class EvictsMostRecentlyUsed(CpuKVTier):
    """evicts the most recently used block: 12 blocks stored in room for 4 keep 0, 1, 2, 11"""
    name = "evicts_most_recently_used"

    def __init__(self, spec, config):
        super().__init__(spec, config)
        self._blocks = NewestOut()


class InStoreOrder(OrderedDict):
    def move_to_end(self, key, last=True):
        pass  # a use does not count: the first stored goes first


class FifoClaimingLru(CpuKVTier):
    """evicts the first stored block whatever its use, yet declares (inherits) lru eviction"""
    name = "fifo_claiming_lru"

    def __init__(self, spec, config):
        super().__init__(spec, config)
        self._blocks = InStoreOrder()


class Fifo(FifoClaimingLru):
    """the same tier declaring what it does: a correct tier"""
    name = "fifo"
    eviction = "fifo"


class LookupIsNoUse(CpuKVTier):
    """a lookup hit does not make a block recently used"""
    name = "lookup_is_no_use"

    def lookup(self, keys):
        order = list(self._blocks)
        n = super().lookup(keys)
        for k in order:
            self._blocks.move_to_end(k)
        return n


class MissesPerBlock(CpuKVTier):
    """counts a miss for every key after a lookup's hits, not one per lookup that stopped short"""
    name = "misses_per_block"

    def lookup(self, keys):
        n = super().lookup(keys)
        self._stats.misses += max(0, len(keys) - n - 1)
        return n


class UncountedLoadFailures(CpuKVTier):
    """does not count the blocks a load could not return"""
    name = "uncounted_load_failures"

    def load(self, keys, into):
        before = self._stats.load_failures
        future = super().load(keys, into)
        self._stats.load_failures = before
        return future


class UncountedEvictions(CpuKVTier):
    """does not count its evictions"""
    name = "uncounted_evictions"

    def store(self, keys, blocks):
        before = self._stats.evicted_blocks
        future = super().store(keys, blocks)
        self._stats.evicted_blocks = before
        return future


class Undead(CpuKVTier):
    """keeps answering after close"""
    name = "undead"

    def close(self):
        pass


class ClosesOnce(CpuKVTier):
    """raises on a second close"""
    name = "closes_once"

    def close(self):
        if self._closed:
            raise RuntimeError("already closed")
        super().close()


class Misnamed(CpuKVTier):
    """registered under another name than its own"""
    name = "something_else"


@engine.hookimpl
def register_kv_tiers(register):
    for cls in (
        Good, Liar, Zeros, Loser, NoCopy, Hoarder, EvictsMostRecentlyUsed, FifoClaimingLru, Fifo, LookupIsNoUse,
        MissesPerBlock, UncountedLoadFailures, UncountedEvictions, Undead, ClosesOnce,
    ):
        register(cls)
    register("misnamed", Misnamed)
'''

# broken variant -> the kit checks that must fail for it
CAUGHT_BY = {
    "liar": ("test_partial_load_and_lookup_of_leading_keys",),
    "zeros": ("test_byte_exact_round_trip[bfloat16]", "test_recurrent_state_snapshots_travel_as_blocks"),
    "loser": ("test_byte_exact_round_trip[float32]",),
    "no_copy": ("test_store_keeps_its_own_copy",),
    "hoarder": ("test_eviction_keeps_within_capacity",),
    "evicts_most_recently_used": ("test_eviction_order_is_lru",),
    "fifo_claiming_lru": ("test_eviction_order_is_lru",),
    "lookup_is_no_use": ("test_eviction_order_is_lru",),
    "misses_per_block": ("test_stats_count_the_traffic",),
    "uncounted_load_failures": ("test_stats_count_the_traffic",),
    "uncounted_evictions": ("test_stats_count_the_traffic",),
    "undead": ("test_closed_tier_refuses_calls",),
    "closes_once": ("test_second_close_is_a_no_op",),
    "misnamed": ("test_discoverable",),
}

# the cpu tier, named by its module path; and the fifo tier that declares its policy
CORRECT = """
from engine.testing.kit import KVTierTests


class Test_by_module_path(KVTierTests):
    plugin = "broken_tiers"
    tier_name = "broken_tiers:Good"


class Test_declared_fifo(KVTierTests):
    plugin = "broken_tiers"
    tier_name = "fifo"
"""

TESTS = kit_subclasses("KVTierTests", "broken_tiers", "tier_name", ["good", *CAUGHT_BY])
GOOD_CHECKS = 13  # every check but the persistence one and the fifo order (the cpu tier declares neither)


def test_every_broken_tier_is_caught_by_its_check(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(pytester.path))
    outcomes = run_kit_in_subprocess(pytester, broken_tiers=PLUGIN, test_tier_kit=TESTS, test_correct_tiers=CORRECT)
    assert_broken_caught_and_good_passes(outcomes, CAUGHT_BY, good_checks=GOOD_CHECKS)
    for name, checks in (("by_module_path", GOOD_CHECKS), ("declared_fifo", GOOD_CHECKS)):
        ran = {check: outcome for (cls, check), outcome in outcomes.items() if cls == f"Test_{name}"}
        assert len(ran) == checks and set(ran.values()) == {"passed"}, (name, ran)
    assert ("Test_declared_fifo", "test_eviction_order_is_fifo") in outcomes
    assert ("Test_declared_fifo", "test_eviction_order_is_lru") not in outcomes  # skipped: not declared
