"""The ``disk`` KV tier: blocks packed into segment files under a directory, the least
recently used segments evicted first, reused across restarts.

Damage is repaired on disk, not only skipped, so that no later start finds it again. A segment
is never changed once written, so one holding a damaged payload (one that failed a load's
checksum, or was cut short as the tier opened) is replaced: its other blocks are read and
checked again and written as a new segment the usual way (a temporary file renamed into place),
which is given the old file's mtime to keep its place in the least-recently-used order; then the
old file is deleted. A writer thread does this after a load; at start-up the tier does it before
it opens. For that while both files are on disk (the new one, smaller, is not counted against
the capacity). A crash between the rename and the delete leaves both: the new one has the
higher number and the same mtime, so the next start indexes it after the old one and its blocks
replace the old copies; the old file, left with nothing whole, is deleted then (its cut-off
blocks counted once more), or once its damaged payloads fail their loads (only a load finds a
flipped byte). Like every segment, the new one is not fsynced: the checksums guard it as they
guarded the old. A repair that cannot write (a full disk, a read-only directory) leaves the
segment as it was, its damaged blocks out of the index until the next start finds them again.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from engine.interfaces.kv_tier import KVTier, KVTierSpec, KVTierStats, check_config_keys, config_number
from engine_kv_tier_disk import directory as layout
from engine_kv_tier_disk.buffers import SpareBuffers, copy_bytes
from engine_kv_tier_disk.directory import DirectoryInUseError
from engine_kv_tier_disk.index import Entry, Segment, SegmentIndex
from engine_kv_tier_disk.segment import (
    HEADER_SIZE,
    MAX_BLOCKS,
    MAX_KEY_BYTES,
    CorruptBlockError,
    CorruptSegmentError,
    encode,
    entry_size,
    read_block,
    read_table,
    valid_key,
)

logger = logging.getLogger("engine.kv_tier_disk")

DEFAULT_CAPACITY_GB = 10.0
DEFAULT_THREADS = 2
PREFIX_KEY_BYTES = 16  # the engine's keys: its prefix cache's block hashes
_DIGEST = re.compile(r"[0-9a-fA-F]{1,128}")


class DiskKVTier(KVTier):
    """Config: ``path`` (required: the root directory, created if missing), ``capacity_gb``
    (GiB of segment files per spec digest, default 10), ``threads`` (writer threads, default 2).

    Blocks live in segment files ``<path>/<digest>/<n>.kvs`` (format in
    :mod:`engine_kv_tier_disk.segment`). ``store`` copies a call's blocks, in the calling
    thread, into one buffer per segment of at most ``segment_bytes`` of blocks, and returns at
    once; a writer thread writes each segment to a temporary file, ``max_write_bytes`` per write
    call, and renames it into place, so a segment file is always whole. Until its segment lands, a block is served
    from that copy (at most ``max_pending_bytes`` of copies wait; stores beyond that are
    dropped rather than stalling the caller).

    ``load`` reads straight into the caller's tensors. The engine waits on a load as soon as
    it asks, so a small load (under ``min_read_job_bytes``) runs in the calling thread and
    returns a completed future: a hand-off would only add latency. A larger one is split into
    contiguous runs of blocks read side by side by ``read_threads`` reader threads, so that
    reads from the disk overlap (file reads and the checksum release the GIL); readers never
    queue behind writes.

    Eviction goes by segment: a hit (lookup or load) on a block, or a store of a block it holds,
    makes its whole segment the most recently used and stamps the segment file's mtime, so the least-recently-used order
    survives a restart, and the least recently used segment is deleted whole. Faults cost
    blocks, never correctness, and never raise: a payload that is damaged fails its load and is
    dropped, and its segment is written anew without it (see the module's docstring); a segment
    that is gone or unreadable drops all its blocks; a segment whose table is damaged is deleted
    when the tier opens, and one cut short is written anew with the blocks still whole in it; a
    write that fails (disk full, read-only, ...) fails its blocks. One open tier per directory
    and digest: an exclusive ``flock`` on ``<path>/<digest>/.lock`` refuses a second one.
    """

    name = "disk"
    persistent = True
    eviction = "lru"  # by segment: a segment's blocks (stored by one call) are used and evicted together
    max_pending_bytes = 2**30  # block copies waiting for a writer thread
    segment_bytes = 16 * 2**20  # a store's blocks are written in segments of at most this many payload bytes
    spare_buffers = 4  # full-segment copy buffers kept for reuse
    # one write call at most: from 2 MiB up, a write sometimes costs the kernel (Linux 6.18, ext4)
    # five to ten times the system time per byte; 256 KiB to 1 MiB measured fastest
    max_write_bytes = 2**20
    min_read_job_bytes = 4 * 2**20  # a load is split into runs of at least this many bytes
    read_threads = 8  # reads wait on the disk more than on the CPU: more of them than cores

    def __init__(self, spec: KVTierSpec, config: Mapping[str, Any]) -> None:
        super().__init__(spec, config)
        check_config_keys(config, ["path", "capacity_gb", "threads"], tier=self.name)
        capacity_gb = config_number(config, "capacity_gb", DEFAULT_CAPACITY_GB, tier=self.name)
        threads = _config_threads(config)
        if not _DIGEST.fullmatch(spec.digest):
            raise ValueError(f"KV tier 'disk': the spec digest names a directory and must be hex, got {spec.digest!r}.")
        self.dtype = getattr(torch, spec.dtype)
        self.block_numel, self.block_bytes = spec.block_numel, spec.block_bytes  # spec computes them per call
        self.capacity_bytes = int(capacity_gb * 2**30)
        one_block = HEADER_SIZE + entry_size(PREFIX_KEY_BYTES) + spec.block_bytes
        self.capacity_blocks = self.capacity_bytes // one_block  # each stored alone; batches fit a few more
        if self.capacity_blocks < 1:
            raise ValueError(
                f"KV tier 'disk': 'capacity_gb'={capacity_gb:g} holds no segment of one block ({one_block} bytes); "
                f"raise it."
            )
        # the most blocks a segment gets: segment_bytes of payloads, and never more than the capacity
        fit = (self.capacity_bytes - HEADER_SIZE) // (spec.block_bytes + entry_size(MAX_KEY_BYTES))
        self.segment_blocks = max(1, min(MAX_BLOCKS, self.segment_bytes // spec.block_bytes, fit))
        self.root = _config_path(config)
        self.directory = os.path.join(self.root, spec.digest)
        try:
            os.makedirs(self.directory, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"KV tier 'disk': 'path' {self.root!r}: cannot create {self.directory!r}: {exc}.") from exc

        self._lock = threading.Lock()  # guards everything below, and unlinks in the directory
        self._index = SegmentIndex()
        self._buffers = SpareBuffers(self.segment_blocks, self.block_numel, self.dtype, self.spare_buffers)
        self._copying: set[bytes] = set()  # blocks a store is copying (outside the lock)
        self._pending: dict[bytes, torch.Tensor] = {}  # copies of blocks whose segments are being written
        self._reserved_bytes = 0  # sizes of the segments being written
        self._segment_numbers = itertools.count()  # replaced by the scan: after every number on disk
        self._last_stamp = 0  # the newest mtime given to a segment (ns); stamps only grow
        self._stats = KVTierStats()
        self._counters = {"corrupt_blocks": 0, "lost_blocks": 0, "dropped_blocks": 0}  # KVTierStats.extra_counters
        self._failing = False  # the last write failed (logged once per run of failures)
        self._closed = False
        try:
            self._lock_fd = layout.lock(self.directory)
        except DirectoryInUseError as exc:
            raise ValueError(
                f"KV tier 'disk': 'path' {self.root!r} is in use: another open disk tier (in this or another "
                f"process) holds {exc}. Give each engine its own path, or close the other tier first."
            ) from None
        try:
            self._load_index()
        except BaseException:
            self._unlock_directory()
            raise
        self._writers = ThreadPoolExecutor(threads, thread_name_prefix="kv-tier-disk-write")
        self._readers = ThreadPoolExecutor(self.read_threads, thread_name_prefix="kv-tier-disk-read")
        logger.info(
            "disk KV tier at %s: %d blocks in %d segments found, capacity %.2f GiB (%d blocks of %d bytes)",
            self.directory,
            len(self._index),
            self._index.num_segments,
            capacity_gb,
            self.capacity_blocks,
            spec.block_bytes,
        )

    # KVTier

    def lookup(self, keys: Sequence[bytes]) -> int:
        touched: list[tuple[str, int]] = []
        with self._lock:
            self._check_open()
            n = 0
            for key in keys:
                if not valid_key(key):
                    break
                if key not in self._pending:
                    entry = self._index.get(key)
                    if entry is None:
                        break
                    self._use(entry.segment, touched)
                n += 1
            self._stats.hits += n
            self._stats.misses += int(n < len(keys))
        layout.touch(touched)
        return n

    def store(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor]) -> Future[list[bool]]:
        pairs = list(zip(keys, blocks, strict=True))
        results = [False] * len(pairs)
        touched: list[tuple[str, int]] = []
        with self._lock:
            self._check_open()
            chosen = self._choose(pairs, results, touched)
            self._copying.update(key for key, _ in chosen)
            runs = [chosen[first : first + self.segment_blocks] for first in range(0, len(chosen), self.segment_blocks)]
            copies = [self._buffers.take(len(run)) for run in runs]  # [blocks, block_numel] each
            paths = [layout.segment_path(self.directory, next(self._segment_numbers)) for _ in runs]
        layout.touch(touched)
        jobs: list[Future[None]] = []
        # copied outside the lock, so that the writers carry on, and segment by segment, so that
        # one segment's write starts while the next is copied
        for run, copy, path in zip(runs, copies, paths):
            for row, (_, i) in zip(copy, run):
                copy_bytes(row, pairs[i][1])
            with self._lock:
                self._copying.difference_update(key for key, _ in run)
                if self._closed:  # closed by another thread meanwhile
                    self._stats.store_failures += len(run)
                    self._buffers.give_back(copy)
                    continue
                self._pending.update((key, row) for (key, _), row in zip(run, copy))
                jobs.append(self._writers.submit(self._write_segment, results, run, copy, path))
        return _when_all(results, jobs)

    def load(self, keys: Sequence[bytes], into: Sequence[torch.Tensor]) -> Future[list[bool]]:
        pairs = list(zip(keys, into, strict=True))
        start = time.perf_counter()
        results = [False] * len(pairs)
        n = len(pairs)
        num_jobs = min(self.read_threads, n, n * self.block_bytes // self.min_read_job_bytes)
        jobs: list[Future[None]] = []
        with self._lock:
            self._check_open()
            for j in range(num_jobs if num_jobs > 1 else 0):
                run = range(n * j // num_jobs, n * (j + 1) // num_jobs)
                jobs.append(self._readers.submit(self._read_job, results, run, pairs))
        if not jobs:
            self._read_job(results, range(n), pairs)
        return _when_all(results, jobs, before=functools.partial(self._add_load_seconds, start))

    def stats(self) -> KVTierStats:
        with self._lock:
            extra = {
                "blocks": len(self._index),
                "segments": self._index.num_segments,
                "pending_blocks": len(self._pending),
                "used_bytes": self._index.used_bytes,
                "capacity_blocks": self.capacity_blocks,
                "capacity_bytes": self.capacity_bytes,
            }
            return dataclasses.replace(self._stats, extra=extra, extra_counters=dict(self._counters))

    def close(self) -> None:
        """Refuse new calls, wait for the pending writes, release the directory."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._writers.shutdown(wait=True)
        self._readers.shutdown(wait=True)
        self._unlock_directory()

    # writes (writer threads)

    def _choose(
        self, pairs: list[tuple[bytes, torch.Tensor]], results: list[bool], touched: list[tuple[str, int]]
    ) -> list[tuple[bytes, int]]:
        """The blocks of ``pairs`` to write, as (key, index in pairs); a key the tier holds or is
        writing already succeeds at once (holding the lock)."""
        chosen: dict[bytes, int] = {}
        for i, (key, block) in enumerate(pairs):
            if not valid_key(key) or not self._is_block(block):
                self._stats.store_failures += 1
                continue
            if key in self._index or key in self._pending or key in self._copying or key in chosen:
                entry = self._index.get(key)  # equal keys are interchangeable blocks
                if entry is not None:
                    self._use(entry.segment, touched)
                self._stats.stored_blocks += 1
                results[i] = True
                continue
            waiting = len(self._pending) + len(self._copying) + len(chosen)
            if waiting and (waiting + 1) * self.block_bytes > self.max_pending_bytes:
                self._stats.store_failures += 1  # the disk is behind: drop rather than stall the caller
                self._counters["dropped_blocks"] += 1
                continue
            chosen[key] = i
        return list(chosen.items())

    def _write_segment(self, results: list[bool], run: list[tuple[bytes, int]], copy: torch.Tensor, path: str) -> None:
        """Write the blocks of ``copy`` (rows in the order of ``run``) as the segment ``path``."""
        start = time.perf_counter()
        keys = [key for key, _ in run]
        payload = copy.view(torch.uint8).numpy()  # [blocks, block_bytes]
        header, table = encode(keys, list(payload))
        size = len(header) + payload.nbytes
        with self._lock:
            self._make_room(size)  # free the space before filling it
            self._reserved_bytes += size
        temp = layout.temp_path(path)
        try:
            self._write_file(temp, (header, payload))
            os.replace(temp, path)
        except Exception as exc:  # a failed write costs these blocks, never the caller
            layout.remove(temp)
            with self._lock:
                self._reserved_bytes -= size
                for key in keys:
                    del self._pending[key]
                self._buffers.give_back(copy)
                self._stats.store_failures += len(keys)
                first = not self._failing
                self._failing = True
            if first:
                logger.warning(
                    "disk KV tier: cannot write %s (%s: %s); blocks that fail to write are dropped",
                    path,
                    type(exc).__name__,
                    exc,
                    exc_info=not isinstance(exc, OSError),
                )
            return
        with self._lock:
            self._reserved_bytes -= size
            self._make_room(size)
            self._index.add(path, size, table)  # its keys were pending, so it empties no other segment
            stamp = self._next_stamp()
            for key, i in run:
                del self._pending[key]
                results[i] = True
            self._buffers.give_back(copy)
            self._stats.stored_blocks += len(keys)
            self._stats.bytes_written += payload.nbytes
            self._stats.store_seconds += time.perf_counter() - start
            if self._failing:
                self._failing = False
                logger.info("disk KV tier: writes to %s succeed again", self.directory)
        layout.touch([(path, stamp)])

    def _write_file(self, path: str, data: Sequence[bytes | memoryview]) -> None:
        """Create the file ``path`` (it must not exist) holding the buffers of ``data`` one after
        another. Every byte the tier puts on disk goes through here."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            for buffer in data:
                view = memoryview(buffer).cast("B")
                while view.nbytes:  # a short write continues where it stopped
                    view = view[os.write(fd, view[: self.max_write_bytes]) :]
        finally:
            os.close(fd)

    # reads (the calling thread or reader threads)

    def _read_job(self, results: list[bool], indices: range, pairs: list[tuple[bytes, torch.Tensor]]) -> None:
        for i in indices:
            results[i] = self._load_block(*pairs[i])

    def _add_load_seconds(self, start: float) -> None:
        with self._lock:
            self._stats.load_seconds += time.perf_counter() - start

    def _load_block(self, key: bytes, out: torch.Tensor) -> bool:
        usable = valid_key(key) and self._is_block(out)
        direct = out.device.type == "cpu" and out.is_contiguous()  # read straight into the caller's memory
        target = out.detach() if direct else torch.empty(self.block_numel, dtype=self.dtype)
        for _ in range(2):  # twice when a repair moved the block to a new segment during the read
            with self._lock:
                copy = self._pending.get(key) if usable else None
                if copy is not None:  # its segment is still being written; copied under the lock, as
                    copy_bytes(out, copy)  # the buffer is reused once the segment lands
                    self._stats.loaded_blocks += 1
                    self._stats.bytes_read += self.block_bytes
                    return True
                entry = self._index.get(key) if usable else None
                if entry is None:
                    self._stats.load_failures += 1
                    return False
            try:
                read_block(entry.segment.path, entry.block, memoryview(target.view(-1).view(torch.uint8).numpy()))
                break
            except (CorruptBlockError, OSError) as exc:
                if self._moved(key, entry):
                    continue
                if isinstance(exc, CorruptBlockError):
                    self._drop_block(key, entry, exc)
                else:
                    self._drop_segment(entry.segment, exc)
                return False
        else:
            with self._lock:
                self._stats.load_failures += 1
            return False
        if not direct:
            copy_bytes(out, target)
        touched: list[tuple[str, int]] = []
        with self._lock:
            self._stats.loaded_blocks += 1
            self._stats.bytes_read += self.block_bytes
            self._use(entry.segment, touched)
        layout.touch(touched)
        return True

    def _moved(self, key: bytes, entry: Entry) -> bool:
        """Whether ``key``'s block lies in another segment than ``entry``'s now (a repair moved it,
        or it was stored anew, since ``entry`` was looked up)."""
        with self._lock:
            current = self._index.get(key)
            return current is not None and current.segment is not entry.segment

    def _drop_block(self, key: bytes, entry: Entry, exc: CorruptBlockError, *, load: bool = True) -> None:
        """A payload failed its read (by a load, or a repair when not ``load``): forget the block,
        and delete the segment's file once it holds no other block, else have a writer thread
        repair the segment, so that the damaged payload is gone from the disk too."""
        with self._lock:
            self._stats.load_failures += int(load)
            if not self._index.drop_block(key, entry):
                return  # evicted or dropped since the read began
            self._counters["corrupt_blocks"] += 1
            if not entry.segment.keys:
                layout.remove(entry.segment.path)
            elif load and not self._closed:  # else close is waiting for the writers to finish
                self._writers.submit(self._repair, entry.segment)
        logger.warning("disk KV tier: dropped a corrupt block: %s", exc)

    def _drop_segment(self, segment: Segment, exc: OSError, *, load: bool = True) -> None:
        """A segment is gone or cannot be read: forget all its blocks and delete what is left of it."""
        with self._lock:
            self._stats.load_failures += int(load)
            lost = self._index.drop_segment(segment)
            if not lost:
                return  # evicted or dropped since the read began
            self._counters["lost_blocks"] += lost
            if not isinstance(exc, FileNotFoundError):
                layout.remove(segment.path)
        if isinstance(exc, FileNotFoundError):
            logger.debug("disk KV tier: %s is gone; dropped its %d blocks", segment.path, lost)
        else:
            logger.warning("disk KV tier: dropped the %d blocks of an unreadable segment: %s", lost, exc)

    # repairs (writer threads, and the start)

    def _repair(self, segment: Segment) -> None:
        """Write the blocks ``segment`` still serves, each read and checked again, as a new
        segment that takes its place, then delete its file: the damaged payloads it lists leave
        the disk, and no later start finds them again. A failure leaves the segment as it is."""
        with self._lock:
            if not self._index.holds(segment):
                return  # evicted, dropped or repaired meanwhile
            entries = sorted((self._index.get(key).block for key in segment.keys), key=lambda block: block.offset)
            path = layout.segment_path(self.directory, next(self._segment_numbers))
        payload = torch.empty(len(entries), self.block_bytes, dtype=torch.uint8).numpy()  # [blocks, block_bytes]
        keys: list[bytes] = []
        for block in entries:
            try:
                read_block(segment.path, block, memoryview(payload[len(keys)]))
            except CorruptBlockError as exc:
                self._drop_block(block.key, Entry(segment, block), exc, load=False)
                continue
            except OSError as exc:
                self._drop_segment(segment, exc, load=False)
                return
            keys.append(block.key)
        if not keys:
            return  # its file went with its last block
        payload = payload[: len(keys)]
        header, table = encode(keys, list(payload))
        temp = layout.temp_path(path)
        try:
            stamp = os.stat(segment.path, follow_symlinks=False).st_mtime_ns  # its place in the LRU order
            self._write_file(temp, (header, payload))
            os.utime(temp, ns=(stamp, stamp))
            os.replace(temp, path)
        except Exception as exc:  # a failed repair leaves the damage to the next start
            layout.remove(temp)
            logger.warning(
                "disk KV tier: cannot write %s without its damaged blocks (%s: %s); the next start tries again",
                segment.path,
                type(exc).__name__,
                exc,
                exc_info=not isinstance(exc, OSError),
            )
            return
        with self._lock:
            repaired = self._index.replace(segment, path, len(header) + payload.nbytes, table)
            layout.remove(segment.path if repaired is not None else path)

    # directory

    def _use(self, segment: Segment, touched: list[tuple[str, int]]) -> None:
        """Make ``segment`` the most recently used; its new mtime goes to ``touched`` (holding the lock)."""
        if self._index.use(segment):
            touched.append((segment.path, self._next_stamp()))

    def _make_room(self, size: int) -> None:
        """Evict least recently used segments until ``size`` more bytes fit (holding the lock)."""
        while self._index.used_bytes + self._reserved_bytes + size > self.capacity_bytes:
            segment = self._index.evict()
            if segment is None:
                return
            self._stats.evicted_blocks += len(segment.keys)
            layout.remove(segment.path)

    def _next_stamp(self) -> int:
        self._last_stamp = layout.next_stamp(self._last_stamp)
        return self._last_stamp

    def _load_index(self) -> None:
        """Index the segments an earlier run left, least recently used first; one whose table is
        damaged is deleted, and one cut short is repaired to the blocks still whole in it."""
        try:
            found = layout.scan(self.directory)
        except OSError as exc:
            raise ValueError(f"KV tier 'disk': 'path' {self.root!r}: cannot read {self.directory!r}: {exc}.") from exc
        block_bytes = self.block_bytes
        cut: list[Segment] = []
        for segment in found:
            self._last_stamp = max(self._last_stamp, segment.mtime_ns)
            try:
                table = read_table(segment.path, block_bytes)
            except CorruptSegmentError as exc:
                as_its_size_says = max(1, (segment.size - HEADER_SIZE) // block_bytes)
                self._counters["corrupt_blocks"] += as_its_size_says
                logger.warning("disk KV tier: deleted a segment whose table is damaged: %s", exc)
                layout.remove(segment.path)
                continue
            except OSError as exc:
                logger.warning("disk KV tier: skipping unreadable %s: %s", segment.path, exc)
                continue
            whole = [block for block in table if block.offset + block_bytes <= segment.size]
            self._counters["corrupt_blocks"] += len(table) - len(whole)
            for emptied in self._index.add(segment.path, segment.size, whole):
                layout.remove(emptied.path)  # every block cut off, or stored again later
            if whole and len(whole) < len(table):
                cut.append(self._index.get(whole[0].key).segment)
        self._segment_numbers = itertools.count(max((s.number for s in found), default=-1) + 1)
        self._make_room(0)  # a smaller capacity than last time: the oldest go
        for segment in cut:
            self._repair(segment)  # unless evicted, or emptied by newer copies, meanwhile

    def _unlock_directory(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    # helpers

    def _is_block(self, tensor: Any) -> bool:
        return isinstance(tensor, torch.Tensor) and tensor.dtype == self.dtype and tensor.numel() == self.block_numel

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("KV tier 'disk' is closed.")


def _config_path(config: Mapping[str, Any]) -> str:
    if "path" not in config:
        raise ValueError(
            "KV tier 'disk': 'path' is required: the directory to keep blocks in, "
            'e.g. {"path": "/var/cache/engine-kv"}.'
        )
    value = config["path"]
    path = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if not isinstance(path, str) or not path:
        raise ValueError(f"KV tier 'disk': 'path' must be a directory path (a non-empty string), got {value!r}.")
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"KV tier 'disk': 'path' {path!r} exists and is not a directory; name a directory.")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"KV tier 'disk': 'path' {path!r} cannot be created: {exc}.") from exc
    return path


def _config_threads(config: Mapping[str, Any]) -> int:
    value = config.get("threads", DEFAULT_THREADS)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"KV tier 'disk': 'threads' must be an integer of at least 1, got {value!r}.")
    return value


def _when_all(
    results: list[bool], jobs: list[Future[None]], before: Callable[[], None] | None = None
) -> Future[list[bool]]:
    """A future of ``results`` that completes once every job (each fills its own slots of
    ``results``) has; ``before`` runs just ahead of that. A job that raised leaves its slots
    False."""
    gathered: Future[list[bool]] = Future()
    remaining = len(jobs)
    lock = threading.Lock()

    def finish(_job: Future[None] | None = None) -> None:
        nonlocal remaining
        with lock:
            remaining -= 1
            last = remaining <= 0
        if last:
            if before is not None:
                before()
            gathered.set_result(results)

    if not jobs:
        finish()
    for job in jobs:
        job.add_done_callback(finish)
    return gathered
