"""The disk KV tier: round trips, segments, LRU on disk and across restarts, faults, config, threads."""

from __future__ import annotations

import contextlib
import errno
import os
import random
import shutil
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import xxhash

from engine.interfaces.kv_tier import KVTierSpec
from engine.plugins.manager import get_plugin_manager
from engine_kv_tier_disk.tier import DiskKVTier

SPEC = KVTierSpec("ab" * 16, "bfloat16", 4, ((4, 2, 8), (4, 2, 8)))  # 256 elements, 512 bytes

# the segment format as its README states it, written out here independently of the tier's code
MAGIC, FORMAT_VERSION, HEADER = b"EKVS", 2, struct.Struct("<4sHHQ")


def segment_size(*key_bytes: int, block_bytes: int = SPEC.block_bytes) -> int:
    """Bytes of a segment holding blocks under keys of these lengths: header, table, payloads."""
    return HEADER.size + sum(1 + k + 8 + block_bytes for k in key_bytes)


ONE_BLOCK = segment_size(16)  # a block stored alone under a 16-byte key: 553 bytes
THREE_BLOCKS_GB = 3 * ONE_BLOCK / 2**30


class StoredBlock(NamedTuple):
    key: bytes
    payload: bytes
    offset: int  # of the payload in its segment file
    segment: Path


def parse_segment(path: Path, block_bytes: int = SPEC.block_bytes) -> list[StoredBlock]:
    """The blocks of a segment file, read by the documented format; fails on anything else."""
    data = path.read_bytes()
    magic, version, count, table_checksum = HEADER.unpack_from(data)
    assert (magic, version) == (MAGIC, FORMAT_VERSION) and count > 0
    pos, entries = HEADER.size, []
    for _ in range(count):
        key = data[pos + 1 : pos + 1 + data[pos]]
        (payload_checksum,) = struct.unpack_from("<Q", data, pos + 1 + len(key))
        entries.append((key, payload_checksum))
        pos += 1 + len(key) + 8
    assert xxhash.xxh3_64_intdigest(data[HEADER.size : pos], seed=count) == table_checksum
    assert len(data) == pos + count * block_bytes
    blocks = []
    for i, (key, payload_checksum) in enumerate(entries):
        offset = pos + i * block_bytes
        payload = data[offset : offset + block_bytes]
        assert xxhash.xxh3_64_intdigest(payload) == payload_checksum
        blocks.append(StoredBlock(key, payload, offset, path))
    return blocks


def segment_files(root: Path | str, spec: KVTierSpec = SPEC) -> list[Path]:
    return sorted((Path(root) / spec.digest).glob("*.kvs"))


def stored_blocks(root: Path | str, spec: KVTierSpec = SPEC) -> dict[bytes, StoredBlock]:
    """Every block in the segment files under ``root``'s digest directory, by key."""
    return {b.key: b for path in segment_files(root, spec) for b in parse_segment(path, spec.block_bytes)}


def make_keys(n: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(16) for _ in range(n)]


def random_block(spec: KVTierSpec = SPEC, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(spec.block_numel, generator=generator).to(getattr(torch, spec.dtype))


def empty_block(spec: KVTierSpec = SPEC) -> torch.Tensor:
    return torch.empty(spec.block_numel, dtype=getattr(torch, spec.dtype))


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def payload_of(block: torch.Tensor) -> bytes:
    return block.view(torch.uint8).numpy().tobytes()


def files_under(root: Path | str, suffix: str) -> list[Path]:
    return sorted(p for p in Path(root).rglob("*") if p.is_file() and p.name.endswith(suffix))


def hold_writes(tier: DiskKVTier, monkeypatch) -> threading.Event:
    """Make the tier's writer threads wait, before writing, until the returned event is set."""
    gate = threading.Event()
    write_file = tier._write_file

    def held_write(path, data):
        gate.wait(10)
        write_file(path, data)

    monkeypatch.setattr(tier, "_write_file", held_write)
    return gate


def open_tier(root: Path, spec: KVTierSpec = SPEC, **config) -> DiskKVTier:
    return DiskKVTier(spec, {"path": str(root), **config})


@pytest.fixture
def tier(tmp_path):
    tier = open_tier(tmp_path)
    yield tier
    tier.close()


# round trips


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_round_trip_is_byte_exact_and_one_store_is_one_segment_in_the_format(tmp_path, dtype):
    spec = KVTierSpec("ab" * 16, dtype, 4, ((4, 2, 8), (4, 2, 8)))
    tier = open_tier(tmp_path, spec)
    keys = make_keys(4)
    blocks = [random_block(spec, seed=i) for i in range(4)]
    assert tier.store(keys, blocks).result() == [True] * 4
    assert tier.lookup(keys) == 4
    out = [empty_block(spec) for _ in keys]
    assert tier.load(keys, out).result() == [True] * 4
    assert all(same_bytes(got, want) for got, want in zip(out, blocks))

    [segment] = segment_files(tmp_path, spec)  # read independently of the tier
    assert [(b.key, b.payload) for b in parse_segment(segment, spec.block_bytes)] == [
        (key, payload_of(block)) for key, block in zip(keys, blocks)
    ]
    size = segment_size(16, 16, 16, 16, block_bytes=spec.block_bytes)
    assert segment.stat().st_size == size

    stats = tier.stats()
    assert (stats.stored_blocks, stats.loaded_blocks, stats.hits, stats.misses) == (4, 4, 4, 0)
    assert stats.bytes_written == stats.bytes_read == 4 * spec.block_bytes
    assert stats.extra["blocks"] == 4 and stats.extra["segments"] == 1 and stats.extra["used_bytes"] == size
    tier.close()


def test_partial_load_fails_only_the_missing_and_unusable_blocks(tier):
    keys = make_keys(4)
    assert tier.store([keys[0], keys[2]], [random_block(seed=0), random_block(seed=2)]).result() == [True, True]
    out = [empty_block() for _ in range(4)]
    out[3] = torch.empty(7, dtype=torch.bfloat16)  # the wrong size for a block
    assert tier.load(keys, out).result() == [True, False, True, False]
    assert same_bytes(out[0], random_block(seed=0)) and same_bytes(out[2], random_block(seed=2))
    assert tier.lookup(keys[:3]) == 1 and tier.lookup(keys[2:3]) == 1 and tier.lookup(keys[1:2]) == 0
    stats = tier.stats()
    assert (stats.loaded_blocks, stats.load_failures) == (2, 2)
    assert (stats.hits, stats.misses) == (2, 2)  # each lookup that stops short misses once


def test_load_into_a_non_contiguous_tensor(tier):
    key = make_keys(1)
    tier.store(key, [random_block(seed=5)]).result()
    out = torch.zeros(SPEC.block_numel, 2, dtype=torch.bfloat16)[:, 0]  # stride 2
    assert tier.load(key, [out]).result() == [True] and same_bytes(out.contiguous(), random_block(seed=5))


def test_store_copies_the_block_before_returning_and_serves_it_until_written(tier, monkeypatch):
    gate = hold_writes(tier, monkeypatch)
    key = make_keys(1)
    given = random_block(seed=3)
    future = tier.store(key, [given])
    given.fill_(0)  # the engine reuses its tensor as soon as store returns
    assert not future.done() and tier.lookup(key) == 1
    out = [empty_block()]
    assert tier.load(key, out).result() == [True] and same_bytes(out[0], random_block(seed=3))
    gate.set()
    assert future.result() == [True]
    assert stored_blocks(tier.root)[key[0]].payload == payload_of(random_block(seed=3))
    assert tier.load(key, out).result() == [True] and same_bytes(out[0], random_block(seed=3))


def test_storing_a_key_again_keeps_the_block_it_has(tier):
    key = make_keys(1)
    tier.store(key, [random_block(seed=1)]).result()
    assert tier.store(key, [random_block(seed=1)]).result() == [True]
    stats = tier.stats()
    assert stats.stored_blocks == 2 and stats.extra["blocks"] == 1 and stats.extra["segments"] == 1


def test_a_store_is_written_in_segments_of_at_most_segment_bytes(tmp_path, monkeypatch):
    monkeypatch.setattr(DiskKVTier, "segment_bytes", 3 * SPEC.block_bytes)
    tier = open_tier(tmp_path)
    keys = make_keys(7)
    assert tier.store(keys, [random_block(seed=i) for i in range(7)]).result() == [True] * 7
    # each segment's buffer is reused for a later one once written: what was stored comes back
    more = make_keys(6, seed=1)
    assert tier.store(more, [random_block(seed=10 + i) for i in range(6)]).result() == [True] * 6
    segments = [[b.key for b in parse_segment(path)] for path in segment_files(tmp_path)]  # in the order written
    assert segments == [keys[0:3], keys[3:6], keys[6:7], more[0:3], more[3:6]]
    out = [empty_block() for _ in range(13)]
    assert tier.load(keys + more, out).result() == [True] * 13
    assert all(same_bytes(out[i], random_block(seed=i if i < 7 else 3 + i)) for i in range(13))
    assert tier.stats().extra["segments"] == 5
    tier.close()


# capacity and least-recently-used order


def test_evicts_least_recently_used_at_capacity(tmp_path):
    tier = open_tier(tmp_path, capacity_gb=THREE_BLOCKS_GB)
    assert tier.capacity_blocks == 3
    keys = make_keys(5)
    for i in range(3):
        tier.store([keys[i]], [random_block(seed=i)]).result()
    tier.load([keys[0]], [empty_block()]).result()  # key 0 becomes the most recently used
    tier.store([keys[3]], [random_block(seed=3)]).result()  # evicts key 1
    assert [tier.lookup([k]) for k in keys[:4]] == [1, 0, 1, 1]  # order now 0, 2, 3
    assert keys[1] not in stored_blocks(tmp_path)
    tier.lookup([keys[0]])  # a lookup hit counts as a use too: order 2, 3, 0
    tier.store([keys[4]], [random_block(seed=4)]).result()  # evicts key 2
    assert [tier.lookup([k]) for k in keys] == [1, 0, 0, 1, 1]
    stats = tier.stats()
    assert stats.evicted_blocks == 2 and stats.extra["blocks"] == 3
    assert sorted(stored_blocks(tmp_path)) == sorted([keys[0], keys[3], keys[4]]) and len(segment_files(tmp_path)) == 3
    tier.close()


def test_eviction_takes_whole_segments_and_a_hit_keeps_its_whole_segment(tmp_path):
    two_blocks = segment_size(16, 16)
    tier = open_tier(tmp_path, capacity_gb=2 * two_blocks / 2**30)  # room for two segments of two blocks
    a, b, c, d, e, f = make_keys(6)
    tier.store([a, b], [random_block(seed=0), random_block(seed=1)]).result()
    tier.store([c, d], [random_block(seed=2), random_block(seed=3)]).result()
    assert tier.lookup([b]) == 1  # the segment of a and b becomes the most recently used
    tier.store([e, f], [random_block(seed=4), random_block(seed=5)]).result()  # evicts c and d together
    assert [tier.lookup([k]) for k in (a, b, c, d, e, f)] == [1, 1, 0, 0, 1, 1]
    assert sorted(stored_blocks(tmp_path)) == sorted([a, b, e, f])
    stats = tier.stats()
    assert stats.evicted_blocks == 2 and stats.extra["segments"] == 2 and stats.extra["used_bytes"] == 2 * two_blocks
    out = [empty_block(), empty_block()]
    assert tier.load([a, f], out).result() == [True, True]
    assert same_bytes(out[0], random_block(seed=0)) and same_bytes(out[1], random_block(seed=5))
    tier.close()


def test_a_store_larger_than_the_capacity_keeps_its_newest_blocks(tmp_path):
    # room for 3 one-block segments (1659 bytes); segments then hold at most 2 blocks, since 2
    # blocks under the longest keys (64 bytes) need 16 + 2 * (73 + 512) = 1186 bytes and 3 need 1771
    tier = open_tier(tmp_path, capacity_gb=THREE_BLOCKS_GB, threads=1)
    keys = make_keys(5)
    assert tier.store(keys, [random_block(seed=i) for i in range(5)]).result() == [True] * 5
    # segments [0, 1] (1090 bytes), [2, 3] (1090: evicts [0, 1]), [4] (553: fits beside [2, 3])
    assert [tier.lookup([k]) for k in keys] == [0, 0, 1, 1, 1]
    stats = tier.stats()
    assert stats.evicted_blocks == 2 and stats.extra["used_bytes"] == segment_size(16, 16) + ONE_BLOCK
    tier.close()


@pytest.mark.parametrize("use", ["load", "lookup"])
def test_lru_order_survives_a_restart(tmp_path, use):
    keys = make_keys(4)
    tier = open_tier(tmp_path, capacity_gb=THREE_BLOCKS_GB)
    for i in range(3):
        tier.store([keys[i]], [random_block(seed=i)]).result()
    if use == "load":
        tier.load([keys[0]], [empty_block()]).result()
    else:
        tier.lookup([keys[0]])
    tier.close()

    blocks = stored_blocks(tmp_path)
    mtimes = [blocks[k].segment.stat().st_mtime_ns for k in keys[:3]]
    assert mtimes[1] < mtimes[2] < mtimes[0]
    tier = open_tier(tmp_path, capacity_gb=THREE_BLOCKS_GB)
    tier.store([keys[3]], [random_block(seed=3)]).result()  # evicts key 1, the least recently used
    assert [tier.lookup([k]) for k in keys] == [1, 0, 1, 1]
    tier.close()


def test_a_smaller_capacity_at_restart_evicts_the_oldest(tmp_path):
    keys = make_keys(3)
    tier = open_tier(tmp_path)
    for i, key in enumerate(keys):
        tier.store([key], [random_block(seed=i)]).result()
    tier.close()
    tier = open_tier(tmp_path, capacity_gb=ONE_BLOCK / 2**30)
    assert [tier.lookup([k]) for k in keys] == [0, 0, 1]
    assert tier.stats().evicted_blocks == 2 and list(stored_blocks(tmp_path)) == [keys[2]]
    tier.close()


# restarts and digests


def test_restart_with_the_same_digest_reuses_blocks_and_another_digest_sees_none(tmp_path):
    keys = make_keys(5)
    blocks = [random_block(seed=i) for i in range(5)]
    tier = open_tier(tmp_path)
    assert tier.store(keys[:3], blocks[:3]).result() == [True] * 3
    assert tier.store(keys[3:], blocks[3:]).result() == [True] * 2
    tier.close()

    tier = open_tier(tmp_path)
    stats = tier.stats()
    assert stats.extra["blocks"] == 5 and stats.extra["segments"] == 2 and tier.lookup(keys) == 5
    assert stats.extra["used_bytes"] == segment_size(16, 16, 16) + segment_size(16, 16)
    out = [empty_block() for _ in keys]
    assert tier.load(keys, out).result() == [True] * 5
    assert all(same_bytes(got, want) for got, want in zip(out, blocks))
    tier.store(make_keys(1, seed=1), [random_block(seed=9)]).result()  # numbered after the segments found
    assert [[b.key for b in parse_segment(path)] for path in segment_files(tmp_path)] == [
        keys[:3],
        keys[3:],
        make_keys(1, seed=1),
    ]
    tier.close()

    other_spec = KVTierSpec("cd" * 16, "bfloat16", 4, ((4, 2, 8), (4, 2, 8)))
    other = open_tier(tmp_path, other_spec)
    assert other.stats().extra["blocks"] == 0 and other.lookup(keys) == 0
    assert other.load(keys[:1], out[:1]).result() == [False]
    other.close()
    assert len(stored_blocks(tmp_path)) == 6


def test_restart_drops_a_write_cut_short_and_keeps_the_whole_blocks_of_a_cut_segment(tmp_path):
    keys = make_keys(5)
    tier = open_tier(tmp_path)
    tier.store(keys[:3], [random_block(seed=i) for i in range(3)]).result()
    tier.close()
    blocks = stored_blocks(tmp_path)
    segment = blocks[keys[0]].segment
    # a crash while writing a segment leaves its temporary file, never a segment file
    leftover = segment.parent / f".{int(segment.stem, 16) + 1:016x}.kvs.123.456.0.tmp"
    leftover.write_bytes(segment.read_bytes()[: blocks[keys[2]].offset])
    # damage from outside: the segment cut in the middle of the second block
    with open(segment, "r+b") as file:
        file.truncate(blocks[keys[1]].offset + 100)
    unrelated = tmp_path / SPEC.digest / "README"
    unrelated.write_text("not a segment")

    tier = open_tier(tmp_path)
    assert not leftover.exists() and unrelated.exists()
    assert [tier.lookup([k]) for k in keys[:3]] == [1, 0, 0]
    stats = tier.stats()
    assert stats.extra_counters["corrupt_blocks"] == 2 and stats.extra["blocks"] == 1
    # the cut segment is written anew with block 0 alone, and deleted
    assert not segment.exists() and stats.extra["used_bytes"] == ONE_BLOCK
    assert list(stored_blocks(tmp_path)) == [keys[0]]
    out = [empty_block()]
    assert tier.load(keys[:1], out).result() == [True] and same_bytes(out[0], random_block(seed=0))
    tier.close()


def test_a_segment_whose_every_block_has_a_newer_copy_is_deleted_at_restart(tmp_path):
    keys = make_keys(2)
    tier = open_tier(tmp_path)
    tier.store(keys, [random_block(seed=0), random_block(seed=1)]).result()
    tier.close()
    [older] = segment_files(tmp_path)
    newer = older.with_name(f"{int(older.stem, 16) + 1:016x}.kvs")  # as a run that stored both again would leave
    shutil.copyfile(older, newer)
    stamp = older.stat().st_mtime_ns + 1
    os.utime(newer, ns=(stamp, stamp))

    tier = open_tier(tmp_path)
    assert not older.exists() and segment_files(tmp_path) == [newer]
    stats = tier.stats()
    assert stats.extra["segments"] == 1 and stats.extra["used_bytes"] == segment_size(16, 16)
    out = [empty_block(), empty_block()]
    assert tier.load(keys, out).result() == [True, True]
    assert same_bytes(out[0], random_block(seed=0)) and same_bytes(out[1], random_block(seed=1))
    tier.close()


def flip_magic(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF
    path.write_bytes(bytes(data))


def flip_key_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[HEADER.size + 1] ^= 0xFF  # the first key's first byte
    path.write_bytes(bytes(data))


def newer_version(path: Path) -> None:
    data = bytearray(path.read_bytes())
    struct.pack_into("<H", data, 4, FORMAT_VERSION + 1)
    path.write_bytes(bytes(data))


def truncate_header(path: Path) -> None:
    with open(path, "r+b") as file:
        file.truncate(HEADER.size // 2)


# a segment whose table cannot be trusted counts the blocks its size can hold, at least one
@pytest.mark.parametrize(
    "damage,counted", [(flip_magic, 2), (flip_key_byte, 2), (newer_version, 2), (truncate_header, 1)]
)
def test_a_segment_with_a_damaged_table_is_deleted_at_restart_and_costs_only_its_blocks(tmp_path, damage, counted):
    keys = make_keys(3)
    tier = open_tier(tmp_path)
    tier.store(keys[:2], [random_block(seed=0), random_block(seed=1)]).result()
    tier.store(keys[2:], [random_block(seed=2)]).result()
    tier.close()
    damaged = stored_blocks(tmp_path)[keys[0]].segment
    damage(damaged)

    tier = open_tier(tmp_path)
    assert not damaged.exists()
    assert [tier.lookup([k]) for k in keys] == [0, 0, 1]
    stats = tier.stats()
    assert stats.extra_counters["corrupt_blocks"] == counted
    assert stats.extra["blocks"] == 1 and stats.extra["segments"] == 1
    out = [empty_block()]
    assert tier.load(keys[2:], out).result() == [True] and same_bytes(out[0], random_block(seed=2))
    tier.close()


def test_one_open_tier_per_directory_and_digest(tmp_path):
    tier = open_tier(tmp_path)
    with pytest.raises(ValueError, match="'path' .* is in use"):
        open_tier(tmp_path)
    tier.close()
    open_tier(tmp_path).close()  # free again once the first is closed


# faults on read


def flip_payload_bytes(blocks: dict[bytes, StoredBlock], keys: list[bytes], at: int = 0) -> None:
    """Flip byte ``at`` of each key's payload in its segment file (they share one segment)."""
    segment = blocks[keys[0]].segment
    data = bytearray(segment.read_bytes())
    for key in keys:
        data[blocks[key].offset + at] ^= 0xFF
    segment.write_bytes(bytes(data))


def flip_first_payload_byte(blocks: dict[bytes, StoredBlock], keys: list[bytes]) -> list[bool]:
    flip_payload_bytes(blocks, keys[:1], at=100)
    return [False, True]


def three_stored_blocks(root: Path) -> tuple[DiskKVTier, list[bytes], list[torch.Tensor]]:
    """A tier at ``root`` holding three random blocks in one segment: (tier, keys, blocks)."""
    keys = make_keys(3)
    blocks = [random_block(seed=i) for i in range(3)]
    tier = open_tier(root)
    tier.store(keys, blocks).result()
    return tier, keys, blocks


def cut_into_second_payload(blocks: dict[bytes, StoredBlock], keys: list[bytes]) -> list[bool]:
    block = blocks[keys[1]]
    with open(block.segment, "r+b") as file:
        file.truncate(block.offset + SPEC.block_bytes // 2)
    return [True, False]


@pytest.mark.parametrize("damage", [flip_first_payload_byte, cut_into_second_payload])
def test_a_damaged_payload_fails_only_its_block_and_the_key_can_be_stored_again(tmp_path, damage):
    keys = make_keys(2)
    tier = open_tier(tmp_path)
    tier.store(keys, [random_block(seed=0), random_block(seed=1)]).result()
    expected = damage(stored_blocks(tmp_path), keys)
    assert tier.lookup(keys) == 2  # lookup trusts the index; the load finds out
    out = [empty_block(), empty_block()]
    assert tier.load(keys, out).result() == expected
    good = expected.index(True)
    assert same_bytes(out[good], random_block(seed=good))
    stats = tier.stats()
    assert stats.load_failures == 1 and stats.extra_counters["corrupt_blocks"] == 1
    assert stats.extra["blocks"] == 1 and stats.extra["segments"] == 1  # the segment still serves the other block
    bad = expected.index(False)
    assert [tier.lookup([k]) for k in keys] == expected
    assert tier.store([keys[bad]], [random_block(seed=bad)]).result() == [True]  # a new segment holds it
    tier.close()

    # the segment was written anew without the damaged copy: every payload on disk checks out
    assert sorted(stored_blocks(tmp_path)) == sorted(keys) and len(segment_files(tmp_path)) == 2
    tier = open_tier(tmp_path)
    assert tier.load(keys, out).result() == [True, True]
    assert same_bytes(out[0], random_block(seed=0)) and same_bytes(out[1], random_block(seed=1))
    assert tier.stats().extra_counters["corrupt_blocks"] == 0
    tier.close()


def test_a_segment_whose_every_block_failed_is_deleted(tier):
    keys = make_keys(2)
    tier.store(keys, [random_block(seed=0), random_block(seed=1)]).result()
    blocks = stored_blocks(tier.root)
    segment = blocks[keys[0]].segment
    flip_payload_bytes(blocks, keys)
    assert tier.load(keys, [empty_block(), empty_block()]).result() == [False, False]
    assert not segment.exists()
    stats = tier.stats()
    assert stats.extra_counters["corrupt_blocks"] == 2
    assert stats.extra["segments"] == 0 and stats.extra["used_bytes"] == 0


def test_a_segment_deleted_behind_the_tiers_back_loses_all_its_blocks(tier):
    keys = make_keys(3)
    tier.store(keys[:2], [random_block(seed=0), random_block(seed=1)]).result()
    tier.store(keys[2:], [random_block(seed=2)]).result()
    stored_blocks(tier.root)[keys[0]].segment.unlink()
    assert tier.lookup(keys) == 3
    out = [empty_block(), empty_block()]
    assert tier.load([keys[0], keys[2]], out).result() == [False, True]
    assert same_bytes(out[1], random_block(seed=2))
    stats = tier.stats()
    assert stats.load_failures == 1 and stats.extra_counters["lost_blocks"] == 2
    assert stats.extra["blocks"] == 1 and stats.extra["used_bytes"] == ONE_BLOCK
    assert [tier.lookup([k]) for k in keys] == [0, 0, 1]  # its other block is gone from the index too


def test_blocks_cut_off_at_start_are_counted_once_and_gone_after_the_next_restart(tmp_path):
    tier, keys, blocks = three_stored_blocks(tmp_path)
    tier.close()
    [segment] = segment_files(tmp_path)
    with open(segment, "r+b") as file:  # the last payload loses its last bytes
        file.truncate(segment.stat().st_size - 7)

    tier = open_tier(tmp_path)
    assert tier.stats().extra_counters["corrupt_blocks"] == 1
    assert [tier.lookup([k]) for k in keys] == [1, 1, 0]
    tier.close()
    # on disk, only whole segments in the format, holding only the whole blocks
    assert sorted(stored_blocks(tmp_path)) == sorted(keys[:2]) and len(segment_files(tmp_path)) == 1

    tier = open_tier(tmp_path)  # nothing damaged is left to find
    assert tier.stats().extra_counters["corrupt_blocks"] == 0
    assert [tier.lookup([k]) for k in keys] == [1, 1, 0]
    out = [empty_block(), empty_block()]
    assert tier.load(keys[:2], out).result() == [True, True]
    assert same_bytes(out[0], blocks[0]) and same_bytes(out[1], blocks[1])
    assert tier.stats().extra["used_bytes"] == segment_size(16, 16)
    tier.close()


def test_a_payload_that_fails_its_checksum_is_never_served_or_counted_again_after_a_restart(tmp_path):
    tier, keys, blocks = three_stored_blocks(tmp_path)
    flip_payload_bytes(stored_blocks(tmp_path), keys[1:2], at=100)
    out = [empty_block() for _ in keys]
    assert tier.load(keys, out).result() == [True, False, True]
    assert tier.stats().extra_counters["corrupt_blocks"] == 1
    tier.close()
    assert sorted(stored_blocks(tmp_path)) == sorted([keys[0], keys[2]])  # every payload on disk checks out

    tier = open_tier(tmp_path)
    assert [tier.lookup([k]) for k in keys] == [1, 0, 1]
    out = [empty_block() for _ in keys]
    assert tier.load(keys, out).result() == [True, False, True]
    assert same_bytes(out[0], blocks[0]) and same_bytes(out[2], blocks[2])
    stats = tier.stats()
    assert stats.extra_counters["corrupt_blocks"] == 0 and stats.load_failures == 1  # the key it no longer has
    tier.close()


def test_a_load_during_a_repair_reads_the_block_from_its_new_segment(tmp_path, monkeypatch):
    import engine_kv_tier_disk.tier as tier_module

    tier, keys, blocks = three_stored_blocks(tmp_path)
    flip_payload_bytes(stored_blocks(tmp_path), keys[:1])
    read_block, repaired = tier_module.read_block, []

    def repair_first(path, entry, into):  # the segment is repaired between the lookup and the read
        if not repaired:
            repaired.append(path)
            tier._repair(tier._index.get(keys[1]).segment)
        read_block(path, entry, into)

    monkeypatch.setattr(tier_module, "read_block", repair_first)
    out = [empty_block()]
    assert tier.load(keys[1:2], out).result() == [True] and same_bytes(out[0], blocks[1])
    assert not os.path.exists(repaired[0])  # it read the old file first, which the repair deleted
    stats = tier.stats()
    assert stats.load_failures == 0 and stats.extra_counters["corrupt_blocks"] == 1
    assert [tier.lookup([k]) for k in keys] == [0, 1, 1]
    tier.close()


def test_a_repair_cut_short_by_a_crash_is_finished_by_the_next_start(tmp_path):
    tier, keys, blocks = three_stored_blocks(tmp_path)
    tier.close()
    [segment] = segment_files(tmp_path)
    with open(segment, "r+b") as file:
        file.truncate(segment.stat().st_size - 7)
    damaged, stamp = segment.read_bytes(), segment.stat().st_mtime_ns
    open_tier(tmp_path).close()  # writes the whole blocks anew and deletes the damaged segment
    assert not segment.exists()
    # a crash after the new segment landed and before the damaged one was deleted
    segment.write_bytes(damaged)
    os.utime(segment, ns=(stamp, stamp))

    tier = open_tier(tmp_path)  # the newer segment holds every whole block: the damaged one goes
    assert not segment.exists() and len(segment_files(tmp_path)) == 1
    assert tier.stats().extra_counters["corrupt_blocks"] == 1  # what it found cut off, once more
    out = [empty_block(), empty_block()]
    assert tier.load(keys[:2], out).result() == [True, True]
    assert same_bytes(out[0], blocks[0]) and same_bytes(out[1], blocks[1])
    tier.close()
    tier = open_tier(tmp_path)
    assert tier.stats().extra_counters["corrupt_blocks"] == 0 and tier.lookup(keys) == 2
    tier.close()


# faults on write


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EACCES])
def test_a_failing_write_fails_its_blocks_leaves_no_temp_files_and_the_tier_recovers(tier, monkeypatch, code):
    def failing_write(path, data):
        with open(path, "xb") as file:  # part of the block lands, then the disk refuses the rest
            file.write(bytes(data[0]))
        raise OSError(code, os.strerror(code), path)

    monkeypatch.setattr(tier, "_write_file", failing_write)
    keys = make_keys(3)
    assert tier.store(keys[:2], [random_block(seed=0), random_block(seed=1)]).result() == [False, False]
    stats = tier.stats()
    assert stats.store_failures == 2 and stats.stored_blocks == 0 and stats.bytes_written == 0
    assert stats.extra["blocks"] == stats.extra["pending_blocks"] == 0
    assert files_under(tier.root, ".tmp") == [] and segment_files(tier.root) == []
    assert tier.lookup(keys[:2]) == 0

    monkeypatch.undo()  # the disk has room again
    assert tier.store(keys, [random_block(seed=i) for i in range(3)]).result() == [True] * 3
    out = [empty_block() for _ in keys]
    assert tier.load(keys, out).result() == [True] * 3
    assert all(same_bytes(out[i], random_block(seed=i)) for i in range(3))
    assert tier.stats().store_failures == 2


@contextlib.contextmanager
def read_only(*directories: Path):
    """Make ``directories`` refuse new entries. Root ignores permission bits, so as root this
    sets the immutable attribute (``chattr +i``), and skips where the filesystem or the
    capabilities do not allow it."""
    if os.geteuid() != 0:
        modes = [d.stat().st_mode for d in directories]
        for d in directories:
            d.chmod(0o555)
        try:
            yield
        finally:
            for d, mode in zip(directories, modes):
                d.chmod(mode)
        return
    chattr = shutil.which("chattr")
    if chattr is None:
        pytest.skip("running as root without chattr: no way to make a directory read-only")
    applied: list[Path] = []
    try:
        for d in directories:
            done = subprocess.run([chattr, "+i", str(d)], check=False, capture_output=True, text=True)
            if done.returncode != 0:
                pytest.skip(f"cannot make a directory read-only as root here: chattr +i: {done.stderr.strip()}")
            applied.append(d)
        with contextlib.suppress(OSError):
            (directories[0] / "probe").touch()
            (directories[0] / "probe").unlink()
            pytest.skip("chattr +i did not make the directory read-only here")
        yield
    finally:
        for d in applied:
            subprocess.run([chattr, "-i", str(d)], check=True)


def test_a_read_only_directory_fails_stores_but_still_serves_loads(tmp_path):
    keys = make_keys(3)
    tier = open_tier(tmp_path)
    tier.store(keys[:1], [random_block(seed=0)]).result()
    with read_only(tmp_path / SPEC.digest):
        assert tier.store(keys[1:], [random_block(seed=1), random_block(seed=2)]).result() == [False, False]
        assert tier.stats().store_failures == 2
        out = [empty_block()]
        assert tier.load(keys[:1], out).result() == [True] and same_bytes(out[0], random_block(seed=0))
        tier.close()
        reopened = open_tier(tmp_path)  # a read-only cache still opens and serves
        assert reopened.lookup(keys[:1]) == 1
        assert reopened.load(keys[:1], out).result() == [True] and same_bytes(out[0], random_block(seed=0))
        assert files_under(tmp_path, ".tmp") == []
    assert reopened.store(keys[1:], [random_block(seed=1), random_block(seed=2)]).result() == [True, True]
    reopened.close()


def test_stores_beyond_the_pending_limit_are_dropped_not_queued(tier, monkeypatch):
    gate = hold_writes(tier, monkeypatch)
    tier.max_pending_bytes = 2 * SPEC.block_bytes
    keys = make_keys(3)
    futures = [tier.store([key], [random_block(seed=i)]) for i, key in enumerate(keys)]
    assert futures[2].done() and futures[2].result() == [False]
    gate.set()
    assert [f.result() for f in futures] == [[True], [True], [False]]
    stats = tier.stats()
    assert stats.store_failures == 1 and stats.extra_counters["dropped_blocks"] == 1 and stats.stored_blocks == 2


# keys


def test_keys_are_data_and_never_name_a_file(tmp_path):
    tier = open_tier(tmp_path)
    hostile = [b"../../../../etc/passwd", b"/etc/shadow", b"..", b"a/../../b", b"\\..\\x", b"\x00\xff/..", b"k" * 64]
    blocks = [random_block(seed=i) for i in range(len(hostile))]
    assert tier.store(hostile, blocks).result() == [True] * 7
    assert tier.lookup(hostile) == 7
    tier.close()
    files = [p for p in tmp_path.rglob("*") if p.is_file() and p.name != ".lock"]
    assert files == segment_files(tmp_path) and len(files) == 1
    assert [(b.key, b.payload) for b in parse_segment(files[0])] == list(zip(hostile, map(payload_of, blocks)))
    tier = open_tier(tmp_path)
    out = [empty_block() for _ in hostile]
    assert tier.load(hostile, out).result() == [True] * 7 and all(map(same_bytes, out, blocks))
    tier.close()


@pytest.mark.parametrize("key", [b"", b"x" * 65, "a string", None, bytearray(b"k" * 16)])
def test_a_key_that_is_not_1_to_64_bytes_fails_its_block_without_raising(tier, key):
    good = make_keys(1)[0]
    assert tier.store([key, good], [random_block(seed=0), random_block(seed=1)]).result() == [False, True]
    assert tier.lookup([key, good]) == 0 and tier.lookup([good, key]) == 1
    assert tier.load([key, good], [empty_block(), empty_block()]).result() == [False, True]
    stats = tier.stats()
    assert stats.store_failures == 1 and stats.load_failures == 1
    assert list(stored_blocks(tier.root)) == [good] and len(segment_files(tier.root)) == 1


# config


@pytest.mark.parametrize(
    "config,message",
    [
        ({}, "'path' is required"),
        ({"path": ""}, "'path' must be a directory path (a non-empty string), got ''"),
        ({"path": 3}, "'path' must be a directory path (a non-empty string), got 3"),
        ({"path": "{tmp}", "capacity_gb": -1}, "'capacity_gb' must be a number above 0, got -1"),
        ({"path": "{tmp}", "capacity_gb": "lots"}, "'capacity_gb' must be a number above 0, got 'lots'"),
        ({"path": "{tmp}", "capacity_gb": 1e-9}, "'capacity_gb'=1e-09 holds no segment of one block (553 bytes)"),
        ({"path": "{tmp}", "threads": 0}, "'threads' must be an integer of at least 1, got 0"),
        ({"path": "{tmp}", "threads": 1.5}, "'threads' must be an integer of at least 1, got 1.5"),
        ({"path": "{tmp}", "threads": True}, "'threads' must be an integer of at least 1, got True"),
        ({"path": "{tmp}", "size": 3}, "unknown config key(s) 'size'; it takes 'path', 'capacity_gb', 'threads'"),
        ({"path": "{file}"}, "exists and is not a directory"),
        ({"path": "{file}/sub"}, "cannot be created"),
    ],
)
def test_bad_config_is_a_clear_error(tmp_path, config, message):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    config = {k: v.format(tmp=tmp_path, file=a_file) if isinstance(v, str) else v for k, v in config.items()}
    with pytest.raises(ValueError) as info:
        DiskKVTier(SPEC, config)
    assert "KV tier 'disk'" in str(info.value) and message in str(info.value)


def test_a_digest_that_is_not_hex_is_refused(tmp_path):
    with pytest.raises(ValueError, match="must be hex"):
        open_tier(tmp_path, KVTierSpec("../x", "bfloat16", 4, ((4, 2, 8),)))


def test_path_is_created_when_missing(tmp_path):
    root = tmp_path / "a" / "b"
    tier = open_tier(root)
    assert (root / SPEC.digest).is_dir() and tier.persistent
    tier.close()


# threads and closing


def test_concurrent_stores_from_several_threads_all_land(tmp_path):
    tier = open_tier(tmp_path, threads=4)
    per_thread, num_threads = 16, 8
    keys = make_keys(per_thread * num_threads)
    futures: list = [None] * num_threads

    def worker(t: int) -> None:
        chunk = range(t * per_thread, (t + 1) * per_thread)
        futures[t] = tier.store([keys[i] for i in chunk], [random_block(seed=i) for i in chunk])

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(f.result() == [True] * per_thread for f in futures)
    assert tier.lookup(keys) == len(keys)
    out = [empty_block() for _ in keys]
    assert tier.load(keys, out).result() == [True] * len(keys)
    assert all(same_bytes(out[i], random_block(seed=i)) for i in range(len(keys)))
    assert tier.stats().stored_blocks == len(keys) and sorted(stored_blocks(tmp_path)) == sorted(keys)
    assert len(segment_files(tmp_path)) == num_threads  # one segment per store
    tier.close()


def test_concurrent_stores_of_the_same_keys_write_each_block_once(tmp_path):
    tier = open_tier(tmp_path, threads=4)
    keys = make_keys(32)
    blocks = [random_block(seed=i) for i in range(32)]
    start = threading.Barrier(4)
    futures: list = [None] * 4

    def worker(t: int) -> None:
        start.wait()
        futures[t] = tier.store(keys, blocks)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(f.result() == [True] * 32 for f in futures)
    tier.close()
    written = [b for path in segment_files(tmp_path) for b in parse_segment(path)]
    assert sorted(b.key for b in written) == sorted(keys)  # every key in exactly one segment
    assert all(b.payload == payload_of(blocks[keys.index(b.key)]) for b in written)


def test_a_large_load_is_split_across_reader_threads_and_keeps_each_flag_in_place(tmp_path, monkeypatch):
    monkeypatch.setattr(DiskKVTier, "read_threads", 3)
    tier = open_tier(tmp_path)
    keys = make_keys(40)
    stored = [i for i in range(40) if i % 4 != 1]
    tier.store([keys[i] for i in stored], [random_block(seed=i) for i in stored]).result()
    flip_first_payload_byte(stored_blocks(tier.root), keys[10:])
    tier.min_read_job_bytes = 2 * SPEC.block_bytes
    threads = set()
    load_block = tier._load_block

    def recording_load(key, out):
        threads.add(threading.current_thread().name)
        return load_block(key, out)

    monkeypatch.setattr(tier, "_load_block", recording_load)
    out = [empty_block() for _ in keys]
    expected = [i in stored and i != 10 for i in range(40)]
    assert tier.load(keys, out).result() == expected
    assert all(same_bytes(out[i], random_block(seed=i)) for i in range(40) if expected[i])
    assert threads and all(name.startswith("kv-tier-disk-read") for name in threads)
    stats = tier.stats()
    assert stats.loaded_blocks == sum(expected) and stats.load_failures == 40 - sum(expected)
    assert stats.extra_counters["corrupt_blocks"] == 1 and stats.load_seconds > 0
    tier.close()


def test_close_waits_for_pending_stores_and_later_calls_raise(tmp_path, monkeypatch):
    tier = open_tier(tmp_path)
    gate = hold_writes(tier, monkeypatch)
    keys = make_keys(4)
    future = tier.store(keys, [random_block(seed=i) for i in range(4)])
    closer = threading.Thread(target=tier.close)
    closer.start()
    closer.join(0.3)
    assert closer.is_alive() and not future.done()  # close waits for the writes
    gate.set()
    closer.join(10)
    assert not closer.is_alive() and future.done() and future.result() == [True] * 4
    assert list(stored_blocks(tmp_path)) == keys

    for call in (
        lambda: tier.lookup(keys),
        lambda: tier.store(keys[:1], [random_block()]),
        lambda: tier.load(keys[:1], [empty_block()]),
    ):
        with pytest.raises(RuntimeError, match="KV tier 'disk' is closed."):
            call()
    tier.close()  # closing again is harmless
    assert tier.stats().stored_blocks == 4


# registration


def test_registers_through_its_entry_point_and_by_module_path():
    assert get_plugin_manager(["kv_tier_disk"]).components().kv_tiers.get("disk") is DiskKVTier
    by_path = get_plugin_manager("").components().kv_tiers.get("engine_kv_tier_disk.tier:DiskKVTier")
    assert by_path is DiskKVTier and DiskKVTier.persistent


def test_the_hook_module_imports_no_torch():
    code = "import sys, engine_kv_tier_disk.plugin; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
