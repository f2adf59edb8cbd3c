"""The ``disk`` KV tier: one file per block under a directory, least recently used evicted
first, reused across restarts."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import torch

from engine.interfaces.kv_tier import KVTier, KVTierSpec, KVTierStats, check_config_keys, config_number
from engine_kv_tier_disk import directory as layout
from engine_kv_tier_disk.blockfile import HEADER_SIZE, CorruptBlockError, encode_header, read_block
from engine_kv_tier_disk.directory import DirectoryInUseError, valid_key

logger = logging.getLogger("engine.kv_tier_disk")

DEFAULT_CAPACITY_GB = 10.0
DEFAULT_THREADS = 2
_DIGEST = re.compile(r"[0-9a-fA-F]{1,128}")


class _Entry(NamedTuple):
    size: int  # bytes on disk
    generation: int  # tells successive files of one key apart


class DiskKVTier(KVTier):
    """Config: ``path`` (required: the root directory, created if missing), ``capacity_gb``
    (GiB of block files per spec digest, default 10), ``threads`` (writer threads, default 2).

    Blocks live in ``<path>/<digest>/<hex[:2]>/<hex>.kvb``, one file per key (format in
    :mod:`engine_kv_tier_disk.blockfile`). ``store`` copies the blocks in the calling thread
    and returns at once; writer threads write each to a temporary file in the same directory
    and rename it into place, so a block file is always whole. Until its file lands, a block
    is served from that copy (at most ``max_pending_bytes`` of copies wait; stores beyond that
    are dropped rather than stalling the caller).

    ``load`` reads straight into the caller's tensors. The engine waits on a load as soon as
    it asks, so a small load (under ``min_read_job_bytes``) runs in the calling thread and
    returns a completed future: a hand-off would only add latency. A larger one is split into
    contiguous runs of blocks read side by side by ``read_threads`` reader threads, so that
    reads from the disk overlap (file reads and the checksum release the GIL); readers never
    queue behind writes.

    A hit (lookup or load) makes a block the most recently used and stamps its file's mtime,
    so the least-recently-used order survives a restart. Faults cost blocks, never
    correctness, and never raise: a file that is corrupt, truncated, unreadable or gone fails
    its load and is dropped; a write that fails (disk full, read-only, ...) fails its block.
    One open tier per directory and digest: an exclusive ``flock`` on ``<path>/<digest>/.lock``
    refuses a second one.
    """

    name = "disk"
    persistent = True
    max_pending_bytes = 2**30  # block copies waiting for a writer thread
    min_read_job_bytes = 4 * 2**20  # a load is split into runs of at least this many bytes
    read_threads = 8  # reads wait on the disk more than on the CPU: more of them than cores

    def __init__(self, spec: KVTierSpec, config: Mapping[str, Any]) -> None:
        super().__init__(spec, config)
        check_config_keys(config, ["path", "capacity_gb", "threads"], tier=self.name)
        capacity_gb = config_number(config, "capacity_gb", DEFAULT_CAPACITY_GB, tier=self.name)
        threads = _config_threads(config)
        if not _DIGEST.fullmatch(spec.digest):
            raise ValueError(
                f"KV tier 'disk': the spec digest names a directory and must be hex, got {spec.digest!r}."
            )
        self.dtype = getattr(torch, spec.dtype)
        self.file_size = HEADER_SIZE + spec.block_bytes
        self.capacity_bytes = int(capacity_gb * 2**30)
        self.capacity_blocks = self.capacity_bytes // self.file_size
        if self.capacity_blocks < 1:
            raise ValueError(
                f"KV tier 'disk': 'capacity_gb'={capacity_gb:g} holds no block file of {self.file_size} bytes; "
                f"raise it."
            )
        self.root = _config_path(config)
        self.directory = os.path.join(self.root, spec.digest)
        try:
            os.makedirs(self.directory, exist_ok=True)
        except OSError as exc:
            raise ValueError(
                f"KV tier 'disk': 'path' {self.root!r}: cannot create {self.directory!r}: {exc}."
            ) from exc

        self._lock = threading.Lock()  # guards everything below, and renames and unlinks in the directory
        self._index: OrderedDict[bytes, _Entry] = OrderedDict()  # block files, least recently used first
        self._pending: dict[bytes, torch.Tensor] = {}  # copies of blocks whose files are being written
        self._used_bytes = 0  # sizes of the indexed files
        self._reserved_bytes = 0  # sizes of the files being written
        self._generations = itertools.count(1)
        self._last_stamp = 0  # the newest mtime given to a file (ns); stamps only grow
        self._stats = KVTierStats()
        self._extra = {"corrupt_blocks": 0, "lost_blocks": 0, "dropped_blocks": 0}
        self._failing = False  # the last write failed (logged once per run of failures)
        self._closed = False
        self._made_dirs: set[str] = set()
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
            "disk KV tier at %s: %d blocks found, capacity %d blocks of %d bytes (%.2f GiB)",
            self.directory, len(self._index), self.capacity_blocks, self.file_size, capacity_gb,
        )

    # KVTier

    def lookup(self, keys: Sequence[bytes]) -> int:
        touched = []
        with self._lock:
            self._check_open()
            n = 0
            for key in keys:
                if not valid_key(key):
                    break
                if key not in self._pending:
                    if key not in self._index:
                        break
                    self._index.move_to_end(key)
                    touched.append((self._block_path(key), self._next_stamp()))
                n += 1
            self._stats.hits += n
            self._stats.misses += int(n < len(keys))
        layout.touch(touched)
        return n

    def store(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor]) -> Future[list[bool]]:
        pairs = list(zip(keys, blocks, strict=True))
        results = [False] * len(pairs)
        jobs: list[Future[None]] = []
        touched = []
        with self._lock:
            self._check_open()
            for i, (key, block) in enumerate(pairs):
                if not valid_key(key) or not self._is_block(block):
                    self._stats.store_failures += 1
                    continue
                if key in self._index or key in self._pending:  # equal keys are interchangeable blocks
                    if key in self._index:
                        self._index.move_to_end(key)
                        touched.append((self._block_path(key), self._next_stamp()))
                    self._stats.stored_blocks += 1
                    results[i] = True
                    continue
                if self._pending and (len(self._pending) + 1) * self.spec.block_bytes > self.max_pending_bytes:
                    self._stats.store_failures += 1  # the disk is behind: drop rather than stall the caller
                    self._extra["dropped_blocks"] += 1
                    continue
                # copied here, block by block, so that each block's write starts while the next is copied
                copy = torch.empty(self.spec.block_numel, dtype=self.dtype)
                copy.view(block.shape).copy_(block.detach())
                self._pending[key] = copy
                jobs.append(self._writers.submit(self._write_job, results, i, key, copy))
        layout.touch(touched)
        return _when_all(results, jobs)

    def load(self, keys: Sequence[bytes], into: Sequence[torch.Tensor]) -> Future[list[bool]]:
        pairs = list(zip(keys, into, strict=True))
        start = time.perf_counter()
        results = [False] * len(pairs)
        n = len(pairs)
        num_jobs = min(self.read_threads, n, n * self.spec.block_bytes // self.min_read_job_bytes)
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
                "pending_blocks": len(self._pending),
                "used_bytes": self._used_bytes,
                "capacity_blocks": self.capacity_blocks,
                "capacity_bytes": self.capacity_bytes,
                **self._extra,
            }
            return dataclasses.replace(self._stats, extra=extra)

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

    def _write_job(self, results: list[bool], index: int, key: bytes, block: torch.Tensor) -> None:
        results[index] = self._write_block(key, block)

    def _write_block(self, key: bytes, block: torch.Tensor) -> bool:
        start = time.perf_counter()
        path = self._block_path(key)
        temp = layout.temp_path(path)
        parent = os.path.dirname(path)
        size = self.file_size
        with self._lock:
            self._make_room(size)  # free the space before filling it
            self._reserved_bytes += size
        reserved = True
        try:
            payload = memoryview(block.view(torch.uint8).numpy())
            header = encode_header(payload)
            if parent not in self._made_dirs:  # 256 subdirectories at most: create each once
                os.makedirs(parent, exist_ok=True)
                self._made_dirs.add(parent)
            self._write_file(temp, (header, payload))
            with self._lock:
                self._reserved_bytes -= size
                reserved = False
                stamp = self._next_stamp()
                os.utime(temp, ns=(stamp, stamp))
                os.replace(temp, path)
                self._make_room(size)
                self._index[key] = _Entry(size, next(self._generations))
                self._used_bytes += size
                del self._pending[key]
                self._stats.stored_blocks += 1
                self._stats.bytes_written += self.spec.block_bytes
                self._stats.store_seconds += time.perf_counter() - start
                if self._failing:
                    self._failing = False
                    logger.info("disk KV tier: writes to %s succeed again", self.directory)
            return True
        except Exception as exc:  # a failed write costs this block, never the caller
            layout.remove(temp)
            self._made_dirs.discard(parent)  # removed behind our back? made again next time
            with self._lock:
                if reserved:
                    self._reserved_bytes -= size
                self._pending.pop(key, None)
                self._stats.store_failures += 1
                first = not self._failing
                self._failing = True
            if first:
                logger.warning(
                    "disk KV tier: cannot write %s (%s: %s); blocks that fail to write are dropped",
                    path, type(exc).__name__, exc, exc_info=not isinstance(exc, OSError),
                )
            return False

    def _write_file(self, path: str, data: Sequence[bytes | memoryview]) -> None:
        """Create the file ``path`` (it must not exist) holding the buffers of ``data`` one after
        another. Every byte the tier puts on disk goes through here."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            total, written = sum(memoryview(d).nbytes for d in data), 0
            buffers = [memoryview(d).cast("B") for d in data]
            while written < total:  # one writev; a short write continues where it stopped
                n = os.writev(fd, buffers)
                written += n
                while buffers and n >= buffers[0].nbytes:
                    n -= buffers[0].nbytes
                    buffers.pop(0)
                if buffers and n:
                    buffers[0] = buffers[0][n:]
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
        with self._lock:
            copy = self._pending.get(key) if usable else None
            entry = self._index.get(key) if usable and copy is None else None
            if copy is None and entry is None:
                self._stats.load_failures += 1
                return False
        if copy is not None:  # its file is still being written
            out.copy_(copy.view(out.shape))
            with self._lock:
                self._stats.loaded_blocks += 1
                self._stats.bytes_read += self.spec.block_bytes
            return True
        path = self._block_path(key)
        direct = out.device.type == "cpu" and out.is_contiguous()  # read straight into the caller's memory
        target = out.detach() if direct else torch.empty(self.spec.block_numel, dtype=self.dtype)
        try:
            read_block(path, memoryview(target.view(-1).view(torch.uint8).numpy()))
        except (CorruptBlockError, OSError) as exc:
            self._drop(key, entry, path, exc)
            return False
        if not direct:
            out.copy_(target.view(out.shape))
        touched = []
        with self._lock:
            self._stats.loaded_blocks += 1
            self._stats.bytes_read += self.spec.block_bytes
            if self._index.get(key) == entry:  # still the file just read
                self._index.move_to_end(key)
                touched.append((path, self._next_stamp()))
        layout.touch(touched)
        return True

    def _drop(self, key: bytes, entry: _Entry, path: str, exc: Exception) -> None:
        """A load of ``entry``'s file failed: forget the block and delete what is left of its file."""
        with self._lock:
            self._stats.load_failures += 1
            if self._index.get(key) != entry:
                return  # evicted or replaced since the read began: nothing of this file to drop
            del self._index[key]
            self._used_bytes -= entry.size
            if isinstance(exc, CorruptBlockError):
                self._extra["corrupt_blocks"] += 1
            else:
                self._extra["lost_blocks"] += 1
            if not isinstance(exc, FileNotFoundError):
                layout.remove(path)
        if isinstance(exc, FileNotFoundError):
            logger.debug("disk KV tier: %s is gone; dropped it", path)
        else:
            logger.warning("disk KV tier: dropped an unusable block file: %s", exc)

    # directory

    def _block_path(self, key: bytes) -> str:
        return layout.block_path(self.directory, key)

    def _make_room(self, size: int) -> None:
        """Evict least recently used blocks until ``size`` more bytes fit (holding the lock)."""
        while self._index and self._used_bytes + self._reserved_bytes + size > self.capacity_bytes:
            key, entry = self._index.popitem(last=False)
            self._used_bytes -= entry.size
            self._stats.evicted_blocks += 1
            layout.remove(self._block_path(key))

    def _next_stamp(self) -> int:
        self._last_stamp = layout.next_stamp(self._last_stamp)
        return self._last_stamp

    def _load_index(self) -> None:
        """Index the block files an earlier run left, oldest mtime first."""
        try:
            found, wrong_size = layout.scan(self.directory, self.file_size)
        except OSError as exc:
            raise ValueError(f"KV tier 'disk': 'path' {self.root!r}: cannot read {self.directory!r}: {exc}.") from exc
        self._extra["corrupt_blocks"] += wrong_size
        for block in found:
            self._index[block.key] = _Entry(block.size, next(self._generations))
            self._used_bytes += block.size
            self._last_stamp = max(self._last_stamp, block.mtime_ns)
        self._make_room(0)  # a smaller capacity than last time: the oldest go

    def _unlock_directory(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    # helpers

    def _is_block(self, tensor: Any) -> bool:
        return (
            isinstance(tensor, torch.Tensor) and tensor.dtype == self.dtype and tensor.numel() == self.spec.block_numel
        )

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
