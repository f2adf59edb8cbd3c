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

import functools
import hashlib
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from engine.distributed.parallel_state import SINGLE, TensorParallel
from engine.interfaces.attention import AttentionSpec
from engine.interfaces.kv_tier import KVTier, KVTierSpec
from engine.runtime.kv_cache import KVCache
from engine.runtime.kv_cache_manager import KVCacheManager
from engine.runtime.request import Request

logger = logging.getLogger("engine")


def tier_spec(kv_cache: KVCache, salt: bytes, dtype: torch.dtype) -> KVTierSpec:
    """The spec of this engine's blocks: the digest covers the prefix-cache salt (model,
    architecture, dtype, block size) and every layer's KV shape with all its KV heads, so
    that it does not depend on the tensor-parallel size."""
    return tier_spec_of([backend.spec for backend in kv_cache.layer_backends], kv_cache.block_size, salt, dtype)


def tier_spec_of(specs: list[AttentionSpec], block_size: int, salt: bytes, dtype: torch.dtype) -> KVTierSpec:
    """:func:`tier_spec` from the model's per-layer specs (before its cache exists)."""
    recurrent = sorted({spec.kind for spec in specs if spec.is_recurrent})
    if recurrent:
        raise ValueError(
            f"KV tiers hold per-token cache blocks; {', '.join(recurrent)} layers keep one state per request."
        )
    shapes = [(block_size, spec.total_kv_heads or spec.num_kv_heads, spec.head_size) for spec in specs]
    keys_only = tuple(i for i, spec in enumerate(specs) if not spec.has_values)
    dtype_name = str(dtype).removeprefix("torch.")
    layout = (salt, dtype_name, tuple(shapes), "canonical-v1") + ((("keys_only", keys_only),) if keys_only else ())
    digest = hashlib.blake2b(repr(layout).encode(), digest_size=16)
    return KVTierSpec(digest.hexdigest(), dtype_name, block_size, tuple(shapes), keys_only)


@dataclass
class ConnectorStats:
    offered_blocks: int = 0  # evicted blocks offered to the tier
    prefetched_blocks: int = 0  # blocks loaded from the tier into the primary cache
    prefetch_failures: int = 0  # blocks the tier listed but could not return
    prefetch_seconds: float = 0.0  # time requests waited for tier loads


class CanonicalBlocks:
    """This rank's cache blocks to and from the canonical layout: per layer, K then V as
    [block_size, all KV heads, head_size] (K alone for a keys-only layer: MLA's latent
    entries, an indexer's keys). Under tensor parallelism a rank holds some of the heads
    (:meth:`TensorParallel.kv_heads`; a latent cache's one head on every rank); rank 0
    gathers every rank's heads into canonical rows, and every rank takes its heads out of
    canonical rows rank 0 sends."""

    def __init__(self, kv_cache: KVCache, spec: KVTierSpec, tp: TensorParallel = SINGLE) -> None:
        self.kv_cache, self.spec, self.tp = kv_cache, spec, tp
        self.dtype = getattr(torch, spec.dtype)
        # per layer and rank: (first head, heads) of the layer's KV heads
        self.placements = [
            [TensorParallel(rank=r, size=tp.size).kv_heads(heads) for r in range(tp.size)]
            for _, heads, _ in spec.layer_shapes
        ]

    def _slots(self, blocks: list[int]) -> torch.Tensor:
        bs = self.kv_cache.block_size
        ids = torch.tensor(blocks, dtype=torch.int64)
        return (ids[:, None] * bs + torch.arange(bs)[None, :]).reshape(-1)

    def local(self, blocks: list[int]) -> torch.Tensor:
        """[len(blocks), n] on the CPU: this rank's heads of each block, layer by layer K then V."""
        slots, parts = self._slots(blocks), []
        for layer, (cache, backend) in enumerate(zip(self.kv_cache.layer_caches, self.kv_cache.layer_backends)):
            k, v = backend.gather_kv(cache, slots.to(cache.device))
            parts += [t.reshape(len(blocks), -1).cpu() for t in (k, v)[: self.spec.tensors(layer)]]
        return torch.cat(parts, dim=1).to(self.dtype)

    def assemble(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """Canonical rows from every rank's :meth:`local` rows (rank order)."""
        n = parts[0].shape[0]
        out = torch.empty(n, self.spec.block_numel, dtype=self.dtype)
        offset, local_offset = 0, 0
        for layer, ((bs, heads, size), placement) in enumerate(zip(self.spec.layer_shapes, self.placements)):
            local_numel = bs * placement[0][1] * size
            for _ in range(self.spec.tensors(layer)):  # keys, then values
                canonical = out[:, offset : offset + bs * heads * size].view(n, bs, heads, size)
                for (first, count), part in zip(placement, parts):
                    local = part[:, local_offset : local_offset + local_numel].view(n, bs, count, size)
                    canonical[:, :, first : first + count] = local
                offset += bs * heads * size
                local_offset += local_numel
        return out

    def write(self, blocks: list[int], rows: torch.Tensor) -> None:
        """Write this rank's heads of canonical ``rows`` into ``blocks`` of its cache."""
        slots, offset = self._slots(blocks), 0
        for layer, (cache, backend, (bs, heads, size), placement) in enumerate(
            zip(self.kv_cache.layer_caches, self.kv_cache.layer_backends, self.spec.layer_shapes, self.placements)
        ):
            first, count = placement[self.tp.rank]
            numel = bs * heads * size
            tensors = [
                rows[:, o : o + numel].reshape(-1, heads, size)[:, first : first + count].to(cache.device).contiguous()
                for o in range(offset, offset + self.spec.tensors(layer) * numel, numel)
            ]
            if len(tensors) == 1:  # keys only: an empty value tensor, as gather_kv gives
                tensors.append(tensors[0].new_empty(tensors[0].shape[0], 0, size))
            backend.scatter_kv(cache, slots.to(cache.device), *tensors)
            offset += self.spec.tensors(layer) * numel


class KVTierConnector:
    """Rank 0's side of the tier. Under tensor parallelism (a ``channel`` to the other ranks)
    every gather and write of blocks is broadcast first, so that each rank contributes or
    takes its KV heads (``engine.engine.workers.serve_steps``)."""

    def __init__(
        self,
        tier: KVTier,
        kv_cache: KVCache,
        manager: KVCacheManager,
        spec: KVTierSpec,
        tp: TensorParallel = SINGLE,
        channel=None,
    ) -> None:
        self.tier = tier
        self.manager = manager
        self.spec = spec
        self.dtype = getattr(torch, spec.dtype)
        self.stats = ConnectorStats()
        manager.record_evictions = True
        self.blocks = CanonicalBlocks(kv_cache, spec, tp)
        self.channel = channel

    # canonical blocks <-> cache blocks

    def gather(self, blocks: list[int]) -> torch.Tensor:
        """[len(blocks), block_numel] on the CPU: each row one block in the canonical layout."""
        if self.channel is None:
            return self.blocks.local(blocks)
        self.channel.send(("kv_gather", blocks))
        return self.blocks.assemble(self.channel.gather(self.blocks.local(blocks)))

    def scatter(self, blocks: list[int], rows: torch.Tensor) -> None:
        if self.channel is not None:
            self.channel.send(("kv_write", blocks, rows))
        self.blocks.write(blocks, rows)

    # offload

    def offload_evicted(self) -> None:
        """Offer the blocks evicted since the last call; their contents are still intact."""
        evicted = self.manager.take_evicted()
        if not evicted:
            return
        rows = self.gather([block for block, _ in evicted])
        self.stats.offered_blocks += len(evicted)
        try:
            future = self.tier.store([key for _, key in evicted], list(rows))
        except Exception as exc:  # a tier's failure loses the offer, never the step
            self._warn("a store", len(evicted), exc)
            return
        future.add_done_callback(functools.partial(self._check_store, len(evicted)))

    def _check_store(self, num_blocks: int, future: Future) -> None:
        exc = future.exception()
        if exc is not None:
            self._warn("a store", num_blocks, exc)

    def _warn(self, what: str, num_blocks: int, exc: BaseException) -> None:
        logger.warning(
            "KV tier %r failed %s of %d blocks: %s: %s", self.tier.name, what, num_blocks, type(exc).__name__, exc
        )

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
        try:
            found = self.tier.lookup(keys)
        except Exception as exc:  # a tier's failure costs a recompute, never the request
            self._warn("a lookup", len(keys), exc)
            return 0
        n = min(found, manager.num_free_blocks - manager.protect(hashes[:hit]))
        if n <= 0:
            return 0
        blocks = manager.take_free_blocks(n)
        self.offload_evicted()  # what those blocks held goes to the tier before it is overwritten
        rows = torch.empty(n, self.spec.block_numel, dtype=self.dtype)
        try:
            results = self.tier.load(keys[:n], list(rows)).result()
        except Exception as exc:  # a tier's failure costs a recompute, never the request
            self._warn("a load", n, exc)
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
