"""``KVTierTests``: a KV tier against an in-memory model of what it was given.

The oracle is a dict of the blocks stored so far. A tier may forget blocks (that
is what capacity means) and a load may fail (the engine recomputes), but a tier
must never return bytes other than the ones stored under a key, never report a
block it cannot have, and never exceed its capacity.
"""

from __future__ import annotations

import threading
import zlib
from pathlib import Path
from typing import Any, ClassVar

import pytest

from engine.testing.kit.base import KitTests, capability_skip

# two layers of [block_size 4, 2 kv heads, head size 8], K and V, and a keys-only layer (an MLA
# latent cache) of [4, 1, 16]: 320 elements a block
LAYER_SHAPES = ((4, 2, 8), (4, 2, 8), (4, 1, 16))
KEYS_ONLY = (2,)
# a hybrid model's two recurrent layers: float32 states of 300 and 170 elements, 1880 bytes a
# snapshot, carried by three blocks of 640 bytes (bfloat16), the last one padded with zeros
STATE_NUMELS = (300, 170)


def make_spec(dtype: str = "bfloat16", digest: str = "0123456789abcdef" * 2, state_numels: tuple = ()) -> Any:
    from engine.interfaces.kv_tier import KVTierSpec

    return KVTierSpec(digest, dtype, 4, LAYER_SHAPES, KEYS_ONLY, state_numels)


def random_block(spec: Any, seed: int) -> Any:
    """Arbitrary bit patterns (NaN and infinity payloads included): a tier stores bytes."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, spec.dtype)
    bits = {2: torch.int16, 4: torch.int32}[spec.element_size]
    info = torch.iinfo(bits)
    return torch.randint(info.min, info.max, (spec.block_numel,), generator=gen, dtype=bits).view(dtype)


def same_bytes(a: Any, b: Any) -> bool:
    import torch

    bits = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(bits), b.view(bits))


def key(i: int) -> bytes:
    return zlib.crc32(str(i).encode()).to_bytes(4, "little") * 4  # 16 bytes, like the prefix hashes


class KVTierTests(KitTests):
    """Subclass with ``plugin`` and ``tier_name``. Override :meth:`config` when the tier
    needs more than a capacity (a directory, a server address); the kit gives each test its
    own empty ``directory``.

    ``plugin``: the entry-point name of the providing plugin, or a dotted module path
    holding its hook implementations (a plugin not installed: ``"my_tier.plugin"``), or
    ``""`` for the engine's built-in tiers. ``tier_name``: the name the plugin registers,
    or a ``module.path:Class`` reference (resolved as ``--kv-tier`` resolves it).

    The exact checks follow the tier's declared capabilities: ``persistent`` (reopening),
    ``eviction`` (``"lru"`` and ``"fifo"`` orders are checked block by block; every policy
    against the capacity)."""

    registry_name = "kv_tiers"
    tier_name: ClassVar[str | None] = None

    def config(self, directory: Path, capacity_bytes: int) -> dict[str, Any]:
        """The tier's ``--kv-tier-config`` for a capacity of ``capacity_bytes``."""
        return {"capacity_gb": capacity_bytes / 2**30}

    # helpers

    def tier_class(self) -> Any:
        return self.resolve(self.required("tier_name"))

    def open(self, directory: Path, *, blocks: int = 1000, spec: Any = None) -> Any:
        """A tier with room for ``blocks`` blocks: their bytes plus 10% for a tier's own
        per-block overhead (headers, index), which still leaves no room for one more."""
        spec = spec or make_spec()
        return self.tier_class()(spec, self.config(directory, int(blocks * spec.block_bytes * 1.1)))

    @pytest.fixture
    def directory(self, tmp_path: Path) -> Path:
        return tmp_path

    # checks

    def test_discoverable(self) -> None:
        """The plugin registers the tier under its declared name (or ``tier_name`` is the
        tier's ``module.path:Class``), as an engine KVTier declaring its eviction policy."""
        from engine.interfaces.kv_tier import KVTier
        from engine.plugins.qualname import is_qualname, resolve_qualname

        tier_name = self.required("tier_name")
        cls = self.tier_class()
        assert isinstance(cls, type) and issubclass(cls, KVTier), f"{tier_name!r} resolves to {cls!r}, not a KVTier"
        if is_qualname(tier_name):
            assert cls is resolve_qualname(tier_name), f"{tier_name!r} resolves to {cls!r}"
        else:
            assert cls.name == tier_name, f"registered as {tier_name!r}, but its class's name is {cls.name!r}"
        assert isinstance(cls.eviction, str) and cls.eviction, f"eviction must name a policy, got {cls.eviction!r}"

    @pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
    def test_byte_exact_round_trip(self, directory: Path, dtype: str) -> None:
        """Every stored bit comes back, whatever the bit pattern."""
        import torch

        spec = make_spec(dtype)
        tier = self.open(directory, spec=spec)
        blocks = [random_block(spec, i) for i in range(5)]
        assert tier.store([key(i) for i in range(5)], blocks).result(timeout=60) == [True] * 5
        assert tier.lookup([key(i) for i in range(5)]) == 5
        out = [torch.empty(spec.block_numel, dtype=getattr(torch, dtype)) for _ in range(5)]
        assert tier.load([key(i) for i in range(5)], out).result(timeout=60) == [True] * 5
        assert all(same_bytes(a, b) for a, b in zip(out, blocks))
        tier.close()

    def test_partial_load_and_lookup_of_leading_keys(self, directory: Path) -> None:
        """lookup counts leading keys only; a load fails exactly the blocks it does not hold."""
        import torch

        spec = make_spec()
        tier = self.open(directory, spec=spec)
        tier.store([key(0), key(1), key(3)], [random_block(spec, i) for i in (0, 1, 3)]).result(timeout=60)
        assert tier.lookup([key(0), key(1), key(2), key(3)]) == 2
        assert tier.lookup([key(2), key(0)]) == 0
        out = [torch.zeros(spec.block_numel, dtype=torch.bfloat16) for _ in range(3)]
        assert tier.load([key(0), key(2), key(3)], out).result(timeout=60) == [True, False, True]
        assert same_bytes(out[0], random_block(spec, 0)) and same_bytes(out[2], random_block(spec, 3))
        tier.close()

    def test_store_keeps_its_own_copy(self, directory: Path) -> None:
        """The engine reuses its tensors as soon as store returns."""
        import torch

        spec = make_spec()
        tier = self.open(directory, spec=spec)
        block = random_block(spec, 7)
        future = tier.store([key(7)], [block])
        block.zero_()
        assert future.result(timeout=60) == [True]
        out = torch.empty(spec.block_numel, dtype=torch.bfloat16)
        assert tier.load([key(7)], [out]).result(timeout=60) == [True]
        assert same_bytes(out, random_block(spec, 7))
        tier.close()

    def test_recurrent_state_snapshots_travel_as_blocks(self, directory: Path) -> None:
        """A hybrid model's spec (recurrent layers' state bytes beside the blocks): a snapshot's
        parts, stored with a block in one call, are blocks of the spec's size like any other and
        come back bit for bit (after a reopen, for persistent tiers), the snapshot whole."""
        import torch

        spec = make_spec(state_numels=STATE_NUMELS)
        assert (spec.block_bytes, spec.state_bytes, spec.state_blocks) == (640, 1880, 3)
        state = torch.randint(-(2**31), 2**31 - 1, (470,), generator=torch.Generator().manual_seed(5))
        state = state.to(torch.int32).view(torch.float32)  # arbitrary bits: NaN payloads included
        parts = spec.state_rows(state)
        keys = [key(0), *spec.state_keys(key(0))]
        assert len(set(keys)) == 4 and all(len(k) == 16 for k in keys)
        tier = self.open(directory, spec=spec)
        assert tier.store(keys, [random_block(spec, 0), *parts]).result(timeout=60) == [True] * 4
        assert tier.stats().bytes_written == 4 * 640
        if self.tier_class().persistent:
            tier.close()
            tier = self.open(directory, spec=spec)
        assert tier.lookup(keys[1:]) == 3
        out = [torch.empty(spec.block_numel, dtype=torch.bfloat16) for _ in range(3)]
        assert tier.load(keys[1:], out).result(timeout=60) == [True] * 3
        raw = torch.cat(out).view(torch.uint8)
        assert torch.equal(raw[:1880], state.view(torch.uint8)) and not raw[1880:].any()
        assert torch.equal(spec.state_of(torch.stack(out)).view(torch.int32), state.view(torch.int32))
        tier.close()

    def test_eviction_keeps_within_capacity(self, directory: Path) -> None:
        """With room for 4 blocks, 12 stores leave at most 4, the newest among them, and
        nothing is evicted while there is room."""
        import torch

        spec = make_spec()
        tier = self.open(directory, blocks=4, spec=spec)
        for i in range(4):
            tier.store([key(i)], [random_block(spec, i)]).result(timeout=60)
        assert tier.lookup([key(i) for i in range(4)]) == 4, "evicted while there was room"
        for i in range(4, 12):
            tier.store([key(i)], [random_block(spec, i)]).result(timeout=60)
        present = [i for i in range(12) if tier.lookup([key(i)]) == 1]
        assert 1 <= len(present) <= 4 and 11 in present, present
        out = torch.empty(spec.block_numel, dtype=torch.bfloat16)
        for i in present:
            if tier.load([key(i)], [out]).result(timeout=60) == [True]:
                assert same_bytes(out, random_block(spec, i)), f"block {i} came back with other bytes"
        tier.close()

    def eviction_survivors(self, directory: Path) -> list[int]:
        """With room for 4 blocks, store blocks 0 to 4 one by one (block 0 goes, whatever the
        policy), then use block 1 by a lookup, block 2 by a load and block 3 by storing it
        again, then store block 5: the blocks still held."""
        import torch

        spec = make_spec()
        tier = self.open(directory, blocks=4, spec=spec)
        for i in range(5):
            assert tier.store([key(i)], [random_block(spec, i)]).result(timeout=60) == [True]
        assert tier.lookup([key(1)]) == 1, "block 1, one of the 4 newest, was evicted"
        out = torch.empty(spec.block_numel, dtype=torch.bfloat16)
        assert tier.load([key(2)], [out]).result(timeout=60) == [True], "block 2, one of the 4 newest, was evicted"
        assert tier.store([key(3)], [random_block(spec, 3)]).result(timeout=60) == [True]
        assert tier.store([key(5)], [random_block(spec, 5)]).result(timeout=60) == [True]
        present = [i for i in range(6) if tier.lookup([key(i)]) == 1]
        for i in present:
            assert tier.load([key(i)], [out]).result(timeout=60) == [True], f"lookup found block {i}, load did not"
            assert same_bytes(out, random_block(spec, i)), f"block {i} came back with other bytes"
        tier.close()
        return present

    def test_eviction_order_is_lru(self, directory: Path) -> None:
        """``eviction = "lru"``: the least recently used block goes first, where a store (of a
        key held already too), a lookup hit and a load each use a block. Of blocks 0 to 5 in
        room for 4 (see :meth:`eviction_survivors`), 1, 2 and 3 were used after 4 was stored,
        so 4 goes when 5 comes."""
        if self.tier_class().eviction != "lru":
            capability_skip("eviction = 'lru'")
        present = self.eviction_survivors(directory)
        assert present == [1, 2, 3, 5], (
            f"blocks held {present}; least recently used first evicts 0, then 4 (used before 1, 2 and 3 "
            f"were used by a lookup, a load and a second store), keeping [1, 2, 3, 5]"
        )

    def test_eviction_order_is_fifo(self, directory: Path) -> None:
        """``eviction = "fifo"``: the first stored block goes first, whatever its use: of blocks
        0 to 5 in room for 4 (see :meth:`eviction_survivors`), 0 and 1 go."""
        if self.tier_class().eviction != "fifo":
            capability_skip("eviction = 'fifo'")
        present = self.eviction_survivors(directory)
        assert present == [2, 3, 4, 5], f"blocks held {present}; first stored first evicted keeps [2, 3, 4, 5]"

    def test_concurrent_stores(self, directory: Path) -> None:
        """Stores from several threads at once all land, each under its own key."""
        import torch

        spec = make_spec()
        tier = self.open(directory, spec=spec)
        futures: list[Any] = []
        lock = threading.Lock()

        def worker(t: int) -> None:
            for i in range(t * 10, t * 10 + 10):
                future = tier.store([key(i)], [random_block(spec, i)])
                with lock:
                    futures.append(future)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert all(f.result(timeout=60) == [True] for f in futures)
        out = [torch.empty(spec.block_numel, dtype=torch.bfloat16) for _ in range(40)]
        assert tier.load([key(i) for i in range(40)], out).result(timeout=60) == [True] * 40
        assert all(same_bytes(out[i], random_block(spec, i)) for i in range(40))
        tier.close()

    def test_stats_count_the_traffic(self, directory: Path) -> None:
        """Each counter counts exactly what :class:`KVTierStats` says, block by block: stores
        (a refused block, a key held already), lookups (full, partial, missing), a partial
        load and evictions, in room for 4 blocks."""
        import torch

        spec = make_spec()
        size = spec.block_bytes
        tier = self.open(directory, blocks=4, spec=spec)

        def stored(ids: list[int]) -> list[bool]:
            return tier.store([key(i) for i in ids], [random_block(spec, i) for i in ids]).result(timeout=60)

        assert stored([0, 1]) == [True, True]
        wrong_size = torch.zeros(spec.block_numel - 1, dtype=torch.bfloat16)
        assert tier.store([key(2)], [wrong_size]).result(timeout=60) == [False], "stored a block of the wrong size"
        assert stored([1]) == [True]  # held already: stored again, nothing new written
        assert tier.lookup([key(0), key(1), key(2), key(0)]) == 2  # 2 hits, 1 miss (it stops at block 2)
        assert tier.lookup([key(5), key(0)]) == 0  # 1 miss
        assert tier.lookup([key(0)]) == 1  # 1 hit
        out = [torch.empty(spec.block_numel, dtype=torch.bfloat16) for _ in range(3)]
        assert tier.load([key(0), key(5), key(1)], out).result(timeout=60) == [True, False, True]
        assert stored([3]) == [True] and stored([4]) == [True]  # 4 blocks: full
        assert tier.lookup([key(0), key(1)]) == 2  # 2 hits; 3 is the least recently used now
        assert stored([6]) == [True] and stored([7]) == [True]  # evicts 3, then 4
        stats = tier.stats()
        tier.close()
        counted = {
            "hits": stats.hits,
            "misses": stats.misses,
            "stored_blocks": stats.stored_blocks,
            "store_failures": stats.store_failures,
            "loaded_blocks": stats.loaded_blocks,
            "load_failures": stats.load_failures,
            "bytes_read": stats.bytes_read,
        }
        expected = {
            "hits": 2 + 0 + 1 + 2,
            "misses": 1 + 1,  # one per lookup that stopped short, not one per block it did not find
            "stored_blocks": 2 + 1 + 2 + 2,  # every block a store returned True for
            "store_failures": 1,
            "loaded_blocks": 2,
            "load_failures": 1,  # the missing block of the load
            "bytes_read": 2 * size,
        }
        assert counted == expected, f"counted {counted}, expected {expected}"
        # block 1's second store may be written again or not
        assert stats.bytes_written in (6 * size, 7 * size), f"bytes_written {stats.bytes_written}, not 6 or 7 blocks"
        if self.tier_class().eviction in ("lru", "fifo"):
            assert stats.evicted_blocks == 2, f"evicted_blocks {stats.evicted_blocks}; 6 blocks in room for 4 evict 2"
        else:
            assert stats.evicted_blocks >= 2, f"evicted_blocks {stats.evicted_blocks}; 6 blocks in room for 4 evict 2"
        assert stats.store_seconds > 0 and stats.load_seconds > 0, (stats.store_seconds, stats.load_seconds)

    def test_closed_tier_refuses_calls(self, directory: Path) -> None:
        """After close, lookup, store and load raise RuntimeError; stats still answers."""
        import torch

        spec = make_spec()
        tier = self.open(directory, spec=spec)
        tier.store([key(0)], [random_block(spec, 0)]).result(timeout=60)
        tier.close()
        with pytest.raises(RuntimeError):
            tier.lookup([key(0)])
        with pytest.raises(RuntimeError):
            tier.store([key(1)], [random_block(spec, 1)])
        with pytest.raises(RuntimeError):
            tier.load([key(0)], [torch.empty(spec.block_numel, dtype=torch.bfloat16)])
        assert tier.stats().stored_blocks == 1

    def test_second_close_is_a_no_op(self, directory: Path) -> None:
        """A second close does nothing (and raises nothing)."""
        tier = self.open(directory)
        tier.close()
        tier.close()

    def test_reopen_keeps_blocks_only_under_the_same_digest(self, directory: Path) -> None:
        """A persistent tier serves, after close and reopen, what it held; never under another digest."""
        import torch

        if not self.tier_class().persistent:
            capability_skip("persistence")
        spec = make_spec()
        tier = self.open(directory, spec=spec)
        tier.store([key(i) for i in range(3)], [random_block(spec, i) for i in range(3)]).result(timeout=60)
        tier.close()
        again = self.open(directory, spec=spec)
        assert again.lookup([key(i) for i in range(3)]) == 3
        out = [torch.empty(spec.block_numel, dtype=torch.bfloat16) for _ in range(3)]
        assert again.load([key(i) for i in range(3)], out).result(timeout=60) == [True] * 3
        assert all(same_bytes(out[i], random_block(spec, i)) for i in range(3))
        again.close()
        other = self.open(directory, spec=make_spec(digest="f" * 32))
        assert other.lookup([key(0)]) == 0
        other.close()

    def test_state_machine_against_an_in_memory_model(self, directory: Path) -> None:
        """Random stores, lookups, loads (partial ones included), capacity pressure and, for
        persistent tiers, close/reopen: every answer is consistent with what was stored."""
        import torch
        from hypothesis import settings
        from hypothesis import strategies as st
        from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

        kit, spec = self, make_spec()
        capacity = 6
        persistent = self.tier_class().persistent
        runs = iter(range(10**6))

        class Machine(RuleBasedStateMachine):
            @initialize()
            def start(self) -> None:
                self.dir = directory / f"run{next(runs)}"
                self.dir.mkdir()
                self.tier = kit.open(self.dir, blocks=capacity, spec=spec)
                # key -> seeds of every version stored under it: a key names interchangeable
                # blocks, so a tier may keep the first version it got or the last
                self.stored: dict[bytes, set[int]] = {}
                self.version = 0

            @rule(ids=st.lists(st.integers(0, 9), min_size=1, max_size=4, unique=True))
            def store(self, ids: list[int]) -> None:
                self.version += 1
                seeds = [1000 * self.version + i for i in ids]
                ok = self.tier.store([key(i) for i in ids], [random_block(spec, s) for s in seeds]).result(timeout=60)
                assert len(ok) == len(ids)
                for i, s, good in zip(ids, seeds, ok):
                    if good:
                        self.stored.setdefault(key(i), set()).add(s)

            @rule(ids=st.lists(st.integers(0, 9), min_size=1, max_size=6))
            def lookup(self, ids: list[int]) -> None:
                n = self.tier.lookup([key(i) for i in ids])
                assert 0 <= n <= len(ids)
                assert all(key(i) in self.stored for i in ids[:n]), "lookup reports a block never stored"

            @rule(ids=st.lists(st.integers(0, 9), min_size=1, max_size=6))
            def load(self, ids: list[int]) -> None:
                out = [torch.empty(spec.block_numel, dtype=torch.bfloat16) for _ in ids]
                ok = self.tier.load([key(i) for i in ids], out).result(timeout=60)
                assert len(ok) == len(ids)
                for i, tensor, good in zip(ids, out, ok):
                    if good:
                        assert key(i) in self.stored, "loaded a block never stored"
                        assert any(same_bytes(tensor, random_block(spec, s)) for s in self.stored[key(i)]), (
                            "a load returned bytes never stored under its key"
                        )

            @rule()
            def reopen(self) -> None:
                self.tier.close()
                self.tier = kit.open(self.dir, blocks=capacity, spec=spec)
                if not persistent:
                    self.stored.clear()

            @invariant()
            def within_capacity(self) -> None:
                if hasattr(self, "tier"):
                    held = sum(self.tier.lookup([key(i)]) for i in range(10))
                    assert held <= capacity

            def teardown(self) -> None:
                if hasattr(self, "tier"):
                    self.tier.close()

        run_state_machine_as_test(
            Machine, settings=settings(max_examples=25, stateful_step_count=20, deadline=None, database=None)
        )
