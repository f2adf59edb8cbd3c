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


def make_spec(dtype: str = "bfloat16", digest: str = "0123456789abcdef" * 2) -> Any:
    from engine.interfaces.kv_tier import KVTierSpec

    return KVTierSpec(digest, dtype, 4, LAYER_SHAPES, KEYS_ONLY)


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
    """Subclass with ``plugin`` (the providing plugin; ``""`` for the engine's built-in
    tiers) and ``tier_name``. Override :meth:`config` when the tier needs more than a
    capacity (a directory, a server address); the kit gives each test its own empty
    ``directory``."""

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
        """The plugin registers the tier under its declared name, as an engine KVTier."""
        from engine.interfaces.kv_tier import KVTier

        cls = self.tier_class()
        assert issubclass(cls, KVTier) and cls.name == self.tier_name

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
        import torch

        spec = make_spec()
        tier = self.open(directory, spec=spec)
        tier.store([key(0), key(1)], [random_block(spec, 0), random_block(spec, 1)]).result(timeout=60)
        tier.load([key(0), key(5)], [torch.empty(spec.block_numel, dtype=torch.bfloat16) for _ in range(2)]).result(
            timeout=60
        )
        stats = tier.stats()
        assert stats.stored_blocks >= 2 and stats.bytes_written >= 2 * spec.block_bytes
        assert stats.loaded_blocks == 1 and stats.bytes_read == spec.block_bytes and stats.load_failures == 1
        tier.close()

    def test_closed_tier_refuses_calls(self, directory: Path) -> None:
        tier = self.open(directory)
        tier.close()
        with pytest.raises(RuntimeError):
            tier.lookup([key(0)])

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
