"""Moves prefix blocks between the primary KV cache and a secondary :class:`KVTier`.

- Offload: blocks the prefix cache evicts (to reuse them for other tokens) are
  copied out in the canonical layout and offered to the tier before the step that
  overwrites them runs; the tier stores them in its own time.
- Close: a persistent tier also gets the cached blocks still in the primary cache.
- Prefetch: when a request arrives, the blocks after its primary prefix hit are
  looked up in the tier; the leading run the tier returns is written into free
  blocks and published in the prefix cache, where the scheduler then finds it like
  any cached prefix. A block the tier fails to return ends the run: the request
  computes it and everything after it, so a partial load only costs time.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass

import torch

from engine.interfaces.kv_tier import KVTier, KVTierSpec
from engine.runtime.kv_cache import KVCache
from engine.runtime.kv_cache_manager import KVCacheManager
from engine.runtime.request import Request

logger = logging.getLogger("engine")


def tier_spec(kv_cache: KVCache, salt: bytes, dtype: torch.dtype) -> KVTierSpec:
    """The spec of this engine's blocks: the digest covers the prefix-cache salt (model,
    architecture, dtype, block size) and every layer's KV shape."""
    shapes = []
    for backend in kv_cache.layer_backends:
        spec = backend.spec
        shapes.append((kv_cache.block_size, spec.num_kv_heads, spec.head_size))
    dtype_name = str(dtype).removeprefix("torch.")
    digest = hashlib.blake2b(repr((salt, dtype_name, tuple(shapes), "canonical-v1")).encode(), digest_size=16)
    return KVTierSpec(digest.hexdigest(), dtype_name, kv_cache.block_size, tuple(shapes))


@dataclass
class ConnectorStats:
    offered_blocks: int = 0  # evicted blocks offered to the tier
    prefetched_blocks: int = 0  # blocks loaded from the tier into the primary cache
    prefetch_failures: int = 0  # blocks the tier listed but could not return
    prefetch_seconds: float = 0.0  # time requests waited for tier loads


class KVTierConnector:
    def __init__(self, tier: KVTier, kv_cache: KVCache, manager: KVCacheManager, spec: KVTierSpec) -> None:
        self.tier = tier
        self.kv_cache = kv_cache
        self.manager = manager
        self.spec = spec
        self.dtype = getattr(torch, spec.dtype)
        self.stats = ConnectorStats()
        manager.record_evictions = True
        # per layer: elements of its K (and of its V) within a canonical block
        self._layer_numel = [bs * heads * size for bs, heads, size in spec.layer_shapes]

    # canonical blocks <-> cache blocks

    def _slots(self, blocks: list[int]) -> torch.Tensor:
        bs = self.kv_cache.block_size
        ids = torch.tensor(blocks, dtype=torch.int64)
        return (ids[:, None] * bs + torch.arange(bs)[None, :]).reshape(-1)

    def gather(self, blocks: list[int]) -> torch.Tensor:
        """[len(blocks), block_numel] on the CPU: each row one block in the canonical layout."""
        out = torch.empty(len(blocks), self.spec.block_numel, dtype=self.dtype)
        slots = self._slots(blocks)
        offset = 0
        for cache, backend, numel in zip(self.kv_cache.layer_caches, self.kv_cache.layer_backends, self._layer_numel):
            k, v = backend.gather_kv(cache, slots.to(cache.device))
            out[:, offset : offset + numel] = k.reshape(len(blocks), numel).cpu()
            out[:, offset + numel : offset + 2 * numel] = v.reshape(len(blocks), numel).cpu()
            offset += 2 * numel
        return out

    def scatter(self, blocks: list[int], rows: torch.Tensor) -> None:
        slots = self._slots(blocks)
        offset = 0
        for cache, backend, (bs, heads, size), numel in zip(
            self.kv_cache.layer_caches, self.kv_cache.layer_backends, self.spec.layer_shapes, self._layer_numel
        ):
            k = rows[:, offset : offset + numel].reshape(-1, heads, size).to(cache.device)
            v = rows[:, offset + numel : offset + 2 * numel].reshape(-1, heads, size).to(cache.device)
            backend.scatter_kv(cache, slots.to(cache.device), k, v)
            offset += 2 * numel

    # offload

    def offload_evicted(self) -> None:
        """Offer the blocks evicted since the last call; their contents are still intact."""
        evicted = self.manager.take_evicted()
        if not evicted:
            return
        rows = self.gather([block for block, _ in evicted])
        self.tier.store([key for _, key in evicted], list(rows))
        self.stats.offered_blocks += len(evicted)

    # prefetch

    def prefetch(self, request: Request) -> int:
        """Load the tier's run of blocks after ``request``'s primary prefix hit into the
        prefix cache. Returns the number of blocks loaded."""
        manager = self.manager
        if not manager.enable_prefix_caching or request.needs_prompt_logits:
            return 0
        hashes = manager.prefix_hashes(request)
        hit = len(manager.leading_cached(hashes))
        keys = hashes[hit:]
        if not keys:
            return 0
        start = time.perf_counter()
        n = min(self.tier.lookup(keys), manager.num_free_blocks - manager.protect(hashes[:hit]))
        if n <= 0:
            return 0
        blocks = manager.take_free_blocks(n)
        self.offload_evicted()  # what those blocks held goes to the tier before it is overwritten
        rows = torch.empty(n, self.spec.block_numel, dtype=self.dtype)
        try:
            results = self.tier.load(keys[:n], list(rows)).result()
        except Exception as exc:  # a tier's failure costs a recompute, never the request
            logger.warning("KV tier %r failed a load of %d blocks: %s: %s", self.tier.name, n, type(exc).__name__, exc)
            results = [False] * n
        loaded = 0
        while loaded < n and loaded < len(results) and results[loaded] is True:
            loaded += 1
        if loaded:
            self.scatter(blocks[:loaded], rows[:loaded])
        manager.publish_loaded(blocks[:loaded], keys[:loaded])
        manager.return_free_blocks(blocks[loaded:])
        self.stats.prefetched_blocks += loaded
        self.stats.prefetch_failures += n - loaded
        self.stats.prefetch_seconds += time.perf_counter() - start
        return loaded

    def close(self) -> None:
        """Close the tier; a persistent one first gets every cached block of the primary cache
        that no request holds, so that the next engine can start from them too."""
        if self.tier.persistent:
            self.offload_cached()
        self.tier.close()

    def offload_cached(self) -> None:
        """Evict every cached block no request holds from the primary cache into the tier."""
        blocks = self.manager.take_free_blocks(self.manager.num_free_blocks)  # evicts (and records) them
        self.offload_evicted()
        self.manager.return_free_blocks(blocks)
