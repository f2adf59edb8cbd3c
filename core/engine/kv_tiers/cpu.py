"""The built-in ``cpu`` KV tier: blocks kept in host RAM, least recently used evicted first
(a store, a lookup hit or a load uses a block)."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any, Mapping, Sequence

import torch

from engine.interfaces.kv_tier import KVTier, KVTierSpec, KVTierStats, check_config_keys, config_number

DEFAULT_CAPACITY_GB = 4.0


def done(result: list[bool]) -> Future[list[bool]]:
    future: Future[list[bool]] = Future()
    future.set_result(result)
    return future


class CpuKVTier(KVTier):
    """Config: ``capacity_gb`` (GiB of RAM for blocks, default 4). Stores and loads are
    memory copies done in the calling thread, so their futures are complete on return."""

    name = "cpu"
    persistent = False
    eviction = "lru"

    def __init__(self, spec: KVTierSpec, config: Mapping[str, Any]) -> None:
        super().__init__(spec, config)
        check_config_keys(config, ["capacity_gb"], tier=self.name)
        capacity = config_number(config, "capacity_gb", DEFAULT_CAPACITY_GB, tier=self.name)
        self.capacity_blocks = int(capacity * 2**30) // spec.block_bytes
        if self.capacity_blocks < 1:
            raise ValueError(
                f"KV tier 'cpu': capacity_gb={capacity:g} holds no block of {spec.block_bytes} bytes; raise it."
            )
        self.dtype = getattr(torch, spec.dtype)
        self._blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # least recently used first
        self._stats = KVTierStats()
        self._lock = threading.Lock()
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("KV tier 'cpu' is closed.")

    def lookup(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            self._check_open()
            n = 0
            for key in keys:
                if key not in self._blocks:
                    break
                self._blocks.move_to_end(key)  # a hit is a use
                n += 1
            self._stats.hits += n
            self._stats.misses += int(n < len(keys))
            return n

    def store(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor]) -> Future[list[bool]]:
        start = time.perf_counter()
        results = []
        with self._lock:
            self._check_open()
            for key, block in zip(keys, blocks, strict=True):
                if block.numel() != self.spec.block_numel or block.dtype != self.dtype:
                    self._stats.store_failures += 1
                    results.append(False)
                    continue
                if key in self._blocks:
                    self._blocks.move_to_end(key)
                else:
                    while len(self._blocks) >= self.capacity_blocks:
                        self._blocks.popitem(last=False)
                        self._stats.evicted_blocks += 1
                    self._blocks[key] = block.detach().to("cpu", copy=True).reshape(-1)
                    self._stats.bytes_written += self.spec.block_bytes
                self._stats.stored_blocks += 1
                results.append(True)
            self._stats.store_seconds += time.perf_counter() - start
        return done(results)

    def load(self, keys: Sequence[bytes], into: Sequence[torch.Tensor]) -> Future[list[bool]]:
        start = time.perf_counter()
        results = []
        with self._lock:
            self._check_open()
            for key, out in zip(keys, into, strict=True):
                block = self._blocks.get(key)
                if block is None or out.numel() != block.numel():
                    self._stats.load_failures += 1
                    results.append(False)
                    continue
                self._blocks.move_to_end(key)
                out.view(-1).copy_(block)
                self._stats.loaded_blocks += 1
                self._stats.bytes_read += self.spec.block_bytes
                results.append(True)
            self._stats.load_seconds += time.perf_counter() - start
        return done(results)

    def stats(self) -> KVTierStats:
        with self._lock:
            return dataclasses.replace(
                self._stats, extra={"blocks": len(self._blocks), "capacity_blocks": self.capacity_blocks}
            )

    def close(self) -> None:
        with self._lock:
            self._blocks.clear()
            self._closed = True
