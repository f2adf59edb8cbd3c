"""``example_sqlite``: a persistent KV tier in one SQLite file.

Each block is a row ``(digest, key, data, used)``; ``used`` (set by a store, a lookup hit and a load) orders the rows for
least-recently-used eviction and survives a restart. Blocks of another spec digest
share the file but are never served. Every call runs in the caller's thread under
one lock (SQLite serialises writes anyway), so the futures it returns are complete.
"""

from __future__ import annotations

import dataclasses
import os
import sqlite3
import threading
import time
from concurrent.futures import Future
from typing import Any, Mapping, Sequence

import torch

from engine.interfaces.kv_tier import KVTier, KVTierSpec, KVTierStats, check_config_keys, config_number

SCHEMA = """
CREATE TABLE IF NOT EXISTS blocks (
    digest TEXT NOT NULL,
    key BLOB NOT NULL,
    data BLOB NOT NULL,
    used INTEGER NOT NULL,
    PRIMARY KEY (digest, key)
);
CREATE INDEX IF NOT EXISTS blocks_lru ON blocks (digest, used);
"""


def _done(result: list[bool]) -> Future[list[bool]]:
    future: Future[list[bool]] = Future()
    future.set_result(result)
    return future


class SqliteKVTier(KVTier):
    """Config: ``path`` (required: the database file, created if missing) and
    ``capacity_gb`` (block bytes kept per digest, default 1)."""

    name = "example_sqlite"
    persistent = True

    def __init__(self, spec: KVTierSpec, config: Mapping[str, Any]) -> None:
        super().__init__(spec, config)
        check_config_keys(config, ["path", "capacity_gb"], tier=self.name)
        capacity = config_number(config, "capacity_gb", 1.0, tier=self.name)
        self.capacity_blocks = int(capacity * 2**30) // spec.block_bytes
        if self.capacity_blocks < 1:
            raise ValueError(f"KV tier {self.name!r}: 'capacity_gb'={capacity:g} holds no block; raise it.")
        path = config.get("path")
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise ValueError(f"KV tier {self.name!r}: 'path' (the database file) is required, got {path!r}.")
        try:
            self._db = sqlite3.connect(os.fspath(path), check_same_thread=False, isolation_level=None)
            self._db.executescript(SCHEMA)
            (self._clock,) = self._db.execute("SELECT COALESCE(MAX(used), 0) FROM blocks").fetchone()
        except sqlite3.Error as exc:
            raise ValueError(
                f"KV tier {self.name!r}: 'path' {os.fspath(path)!r} is not a usable database: {exc}"
            ) from exc
        self.dtype = getattr(torch, spec.dtype)
        self._lock = threading.Lock()
        self._stats = KVTierStats()
        self._closed = False

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"KV tier {self.name!r} is closed.")

    def lookup(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            self._check_open()
            n = 0
            for key in keys:
                found = self._db.execute(
                    "UPDATE blocks SET used = ? WHERE digest = ? AND key = ?", (self._tick(), self.spec.digest, key)
                )
                if found.rowcount == 0:  # a hit is a use: it moves the block to the back of the eviction order
                    break
                n += 1
            self._db.commit()
            self._stats.hits += n
            self._stats.misses += int(n < len(keys))
            return n

    def store(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor]) -> Future[list[bool]]:
        start = time.perf_counter()
        results = []
        with self._lock:
            self._check_open()
            for key, block in zip(keys, blocks, strict=True):
                if block.dtype != self.dtype or block.numel() != self.spec.block_numel:
                    self._stats.store_failures += 1
                    results.append(False)
                    continue
                data = block.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                try:
                    self._db.execute(
                        "INSERT OR REPLACE INTO blocks VALUES (?, ?, ?, ?)", (self.spec.digest, key, data, self._tick())
                    )
                    self._evict()
                except sqlite3.Error:
                    self._stats.store_failures += 1
                    results.append(False)
                    continue
                self._stats.stored_blocks += 1
                self._stats.bytes_written += len(data)
                results.append(True)
            self._stats.store_seconds += time.perf_counter() - start
        return _done(results)

    def _evict(self) -> None:
        (count,) = self._db.execute("SELECT COUNT(*) FROM blocks WHERE digest = ?", (self.spec.digest,)).fetchone()
        excess = count - self.capacity_blocks
        if excess > 0:
            self._db.execute(
                "DELETE FROM blocks WHERE rowid IN (SELECT rowid FROM blocks WHERE digest = ? ORDER BY used LIMIT ?)",
                (self.spec.digest, excess),
            )
            self._stats.evicted_blocks += excess

    def load(self, keys: Sequence[bytes], into: Sequence[torch.Tensor]) -> Future[list[bool]]:
        start = time.perf_counter()
        results = []
        with self._lock:
            self._check_open()
            for key, out in zip(keys, into, strict=True):
                row = self._db.execute(
                    "SELECT data FROM blocks WHERE digest = ? AND key = ?", (self.spec.digest, key)
                ).fetchone()
                if row is None or len(row[0]) != self.spec.block_bytes or out.numel() != self.spec.block_numel:
                    self._stats.load_failures += 1
                    results.append(False)
                    continue
                out.view(-1).copy_(torch.frombuffer(bytearray(row[0]), dtype=torch.uint8).view(out.dtype))
                self._db.execute(
                    "UPDATE blocks SET used = ? WHERE digest = ? AND key = ?", (self._tick(), self.spec.digest, key)
                )
                self._stats.loaded_blocks += 1
                self._stats.bytes_read += len(row[0])
                results.append(True)
            self._stats.load_seconds += time.perf_counter() - start
        return _done(results)

    def stats(self) -> KVTierStats:
        with self._lock:
            if self._closed:
                return dataclasses.replace(self._stats)
            (count,) = self._db.execute("SELECT COUNT(*) FROM blocks WHERE digest = ?", (self.spec.digest,)).fetchone()
            return dataclasses.replace(self._stats, extra={"blocks": count, "capacity_blocks": self.capacity_blocks})

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._db.close()
                self._closed = True
