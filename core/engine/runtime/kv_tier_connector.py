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

Models with recurrent layers also need the state those layers had at a prefix's end.
The snapshots prefix caching keeps of it (engine.runtime.kv_cache_manager) go to the
tier beside the blocks, as blocks of their own (``KVTierSpec.state_keys``), when their
block is evicted or their row is taken for a newer one; a prefix comes back from the
tier only as far as the furthest block boundary whose snapshot comes back whole, into a
snapshot row, from where the request's first step copies it into its state slot.
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
    architecture, dtype, block size), every layer's KV shape with all its KV heads and every
    recurrent layer's state size, so that it does not depend on the tensor-parallel size."""
    return tier_spec_of([backend.spec for backend in kv_cache.layer_backends], kv_cache.block_size, salt, dtype)


def tier_spec_of(specs: list[AttentionSpec], block_size: int, salt: bytes, dtype: torch.dtype) -> KVTierSpec:
    """:func:`tier_spec` from the model's per-layer specs (before its cache exists)."""
    paged = [spec for spec in specs if not spec.is_recurrent]
    if not paged:
        raise ValueError(
            f"KV tiers hold prefix-cache blocks of per-token caches; every layer of this model is recurrent "
            f"({', '.join(sorted({spec.kind for spec in specs}))}) and caches none. Run it without --kv-tier."
        )
    shapes = [(block_size, spec.total_kv_heads or spec.num_kv_heads, spec.head_size) for spec in paged]
    keys_only = tuple(i for i, spec in enumerate(paged) if not spec.has_values)
    state_numels = tuple(spec.canonical_state_numel() for spec in specs if spec.is_recurrent)
    dtype_name = str(dtype).removeprefix("torch.")
    layout = (salt, dtype_name, tuple(shapes), "canonical-v1") + ((("keys_only", keys_only),) if keys_only else ())
    if state_numels:
        layout += (("states", state_numels),)
    digest = hashlib.blake2b(repr(layout).encode(), digest_size=16)
    return KVTierSpec(digest.hexdigest(), dtype_name, block_size, tuple(shapes), keys_only, state_numels)


@dataclass
class ConnectorStats:
    offered_blocks: int = 0  # evicted blocks offered to the tier
    prefetched_blocks: int = 0  # blocks loaded from the tier into the primary cache
    prefetch_failures: int = 0  # blocks the tier listed but could not return
    prefetch_seconds: float = 0.0  # time requests waited for tier loads
    offered_states: int = 0  # recurrent-state snapshots offered to the tier (models with recurrent layers)
    prefetched_states: int = 0  # snapshots loaded from the tier into a snapshot row


class CanonicalBlocks:
    """This rank's cache blocks to and from the canonical layout: per layer, K then V as
    [block_size, all KV heads, head_size] (K alone for a keys-only layer: MLA's latent
    entries, an indexer's keys). Under tensor parallelism a rank holds some of the heads
    (:meth:`TensorParallel.kv_heads`; a latent cache's one head on every rank); rank 0
    gathers every rank's heads into canonical rows, and every rank takes its heads out of
    canonical rows rank 0 sends. Recurrent layers' state rows go to and from a snapshot's
    float32 elements, each layer's whole state (its convolution inputs over all channels, then
    its recurrent matrix over all heads): rank 0 assembles every rank's part
    (:meth:`local_state`, :meth:`assemble_state`), and every rank writes its part of the whole
    (:meth:`write_state`), as each layer's spec places it (``AttentionSpec.state_placement``)."""

    def __init__(self, kv_cache: KVCache, spec: KVTierSpec, tp: TensorParallel = SINGLE) -> None:
        self.kv_cache, self.spec, self.tp = kv_cache, spec, tp
        self.dtype = getattr(torch, spec.dtype)
        backends = kv_cache.layer_backends
        # (cache, backend) of the layers with per-token caches, in spec.layer_shapes' order
        self.paged = [(c, b) for c, b in zip(kv_cache.layer_caches, backends) if not b.spec.is_recurrent]
        # the recurrent layers' state caches: a row per request slot and snapshot, and their specs
        recurrent = [(c, b.spec) for c, b in zip(kv_cache.layer_caches, backends) if b.spec.is_recurrent]
        self.states = [c for c, _ in recurrent]
        self.state_specs = [layer_spec for _, layer_spec in recurrent]
        for (cache, layer_spec), numel in zip(recurrent, spec.state_numels, strict=True):
            if cache[0].numel() != layer_spec.state_numel() or layer_spec.canonical_state_numel() != numel:
                raise ValueError(
                    f"A recurrent layer's state rows hold {cache[0].numel()} elements ({numel} with all its heads), "
                    f"its spec says {layer_spec.state_numel()} ({layer_spec.canonical_state_numel()}): KV tiers "
                    f"read a state row as its convolution inputs, then its recurrent matrix."
                )
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
        for layer, (cache, backend) in enumerate(self.paged):
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
        for layer, ((cache, backend), (bs, heads, size), placement) in enumerate(
            zip(self.paged, self.spec.layer_shapes, self.placements)
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

    def local_state(self, row: int) -> torch.Tensor:
        """This rank's part of the snapshot in state row ``row`` of every recurrent layer, one
        after another: float32 on the CPU (on a single rank, the whole snapshot)."""
        return torch.cat([cache[row].reshape(-1).float().cpu() for cache in self.states])

    def assemble_state(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The whole snapshot from every rank's :meth:`local_state` (rank order)."""
        if len(parts) == 1:
            return parts[0]
        out = torch.empty(sum(self.spec.state_numels), dtype=torch.float32)
        for rank, part in enumerate(parts):
            self._copy_state(out, part, rank, into_local=False)
        return out

    def write_state(self, row: int, state: torch.Tensor) -> None:
        """Write this rank's part of a whole snapshot (:meth:`assemble_state`'s, or a single
        rank's :meth:`local_state`) into state row ``row`` of every recurrent layer."""
        sizes = [cache[0].numel() for cache in self.states]
        mine = state
        if self.tp.size > 1:
            mine = torch.empty(sum(sizes), dtype=torch.float32)
            self._copy_state(state, mine, self.tp.rank, into_local=True)
        for cache, part in zip(self.states, mine.split(sizes), strict=True):
            cache[row] = part.view(cache.shape[1:]).to(device=cache.device, dtype=cache.dtype)

    def _copy_state(self, whole: torch.Tensor, local: torch.Tensor, rank: int, *, into_local: bool) -> None:
        """Copy rank ``rank``'s part of each recurrent layer's state between the whole snapshot
        ``whole`` and that rank's ``local`` part, into ``local`` or into ``whole``."""
        for (whole_conv, whole_matrix), (local_conv, local_matrix), layer_spec in self._state_views(whole, local):
            runs, first_head = layer_spec.state_placement(rank)
            pairs = [(whole_conv[:, f : f + n], local_conv[:, lf : lf + n]) for f, lf, n in runs]
            pairs.append((whole_matrix[first_head : first_head + local_matrix.shape[0]], local_matrix))
            for whole_part, local_part in pairs:
                (local_part if into_local else whole_part).copy_(whole_part if into_local else local_part)

    def _state_views(self, whole: torch.Tensor, local: torch.Tensor):
        """Per recurrent layer: ((convolution inputs [taps, channels], matrix [heads, ...]) of the
        whole snapshot ``whole``, the same of this rank's part ``local``, the layer's spec)."""
        offsets = [0, 0]
        for layer_spec in self.state_specs:
            views = []
            for i, (flat, part_spec) in enumerate(((whole, layer_spec.whole()), (local, layer_spec))):
                taps, channels, numel = part_spec.conv_kernel - 1, part_spec.conv_channels, part_spec.state_numel()
                layer = flat[offsets[i] : offsets[i] + numel]
                views.append(
                    (
                        layer[: taps * channels].view(taps, channels),
                        layer[taps * channels :].view(part_spec.num_heads, -1),
                    )
                )
                offsets[i] += numel
            yield views[0], views[1], layer_spec


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

    def gather_state(self, row: int) -> torch.Tensor:
        """The whole snapshot in state row ``row`` (every rank's part of it), float32 on the CPU."""
        if self.channel is None:
            return self.blocks.local_state(row)
        self.channel.send(("state_gather", row))
        return self.blocks.assemble_state(self.channel.gather(self.blocks.local_state(row)))

    def scatter_state(self, row: int, state: torch.Tensor) -> None:
        if self.channel is not None:
            self.channel.send(("state_write", row, state))
        self.blocks.write_state(row, state)

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
        """Offer the blocks evicted since the last call, and the recurrent-state snapshots dropped
        since then; their contents are still intact. One store: a snapshot's parts and the blocks
        evicted with it share their fate in the tier."""
        evicted = self.manager.take_evicted()
        states = self.manager.take_evicted_states()
        if not evicted and not states:
            return
        keys = [key for _, key in evicted]
        rows = list(self.gather([block for block, _ in evicted])) if evicted else []
        for h, row in states:
            keys += self.spec.state_keys(h)
            rows += list(self.spec.state_rows(self.gather_state(row)))
        self.stats.offered_blocks += len(evicted)
        self.stats.offered_states += len(states)
        try:
            future = self.tier.store(keys, rows)
        except Exception as exc:  # a tier's failure loses the offer, never the step
            self._warn("a store", len(keys), exc)
            return
        future.add_done_callback(functools.partial(self._check_store, len(keys)))

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
        if self.spec.state_numels:
            return self._prefetch_with_state(hashes, hit)
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
        loaded, _ = self._load(keys[:n], blocks, 0)
        manager.publish_loaded(blocks[:loaded], keys[:loaded])
        manager.return_free_blocks(blocks[loaded:])
        self.stats.prefetch_seconds += time.perf_counter() - start
        return loaded

    def _load(self, keys: list[bytes], blocks: list[int], state_parts: int) -> tuple[int, torch.Tensor | None]:
        """Load ``keys`` (the blocks' keys, then a snapshot's ``state_parts`` part keys) and write
        the leading run of blocks that came back into ``blocks``. Returns that run's length and
        the snapshot, None unless every block and part came back."""
        n = len(blocks)
        rows = torch.empty(len(keys), self.spec.block_numel, dtype=self.dtype)
        try:
            results = self.tier.load(keys, list(rows)).result()
        except Exception as exc:  # a tier's failure costs a recompute, never the request
            self._warn("a load", len(keys), exc)
            results = [False] * len(keys)
        loaded = 0
        while loaded < n and loaded < len(results) and results[loaded] is True:
            loaded += 1
        if loaded:
            self.scatter(blocks[:loaded], rows[:loaded])
        self.stats.prefetched_blocks += loaded
        self.stats.prefetch_failures += n - loaded
        whole = loaded == n and len(results) == len(keys) and all(r is True for r in results[n:])
        return loaded, self.spec.state_of(rows[n:]) if state_parts and whole else None

    def _prefetch_with_state(self, hashes: list[bytes], hit: int) -> int:
        """A model with recurrent layers resumes a prefix only where a snapshot of their state ends
        it: load the blocks up to the furthest block boundary past the primary cache's own
        snapshots whose snapshot the tier holds too, then that snapshot into a snapshot row. A
        prefix whose snapshots are missing from the tier, or fail to load, resumes at the last
        boundary before whose snapshot comes back, if any."""
        manager = self.manager
        if manager.num_state_snapshots == 0:
            return 0
        own = hit  # the primary cache's furthest snapshot within its hit
        while own and hashes[own - 1] not in manager.snapshots:
            own -= 1
        start = time.perf_counter()
        try:
            found = self.tier.lookup(hashes[hit:]) if hit < len(hashes) else 0
            reach = hit + max(0, min(found, manager.num_free_blocks - manager.protect(hashes[:hit])))
            end = self._last_tier_snapshot(hashes, own, reach)
        except Exception as exc:  # a tier's failure costs a recompute, never the request
            self._warn("a lookup", len(hashes) - hit, exc)
            return 0
        row = manager.take_snapshot_row() if end > own else None
        if row is None:
            return 0
        blocks = manager.take_free_blocks(max(0, end - hit))
        self.offload_evicted()  # what those blocks and the row held goes to the tier before it is overwritten
        keys = hashes[hit:end]
        loaded, state = self._load(keys + self.spec.state_keys(hashes[end - 1]), blocks, self.spec.state_blocks)
        manager.publish_loaded(blocks[:loaded], keys[:loaded])
        manager.return_free_blocks(blocks[loaded:])
        while state is None and end > own:  # a block or part did not come back: an earlier snapshot?
            try:
                end = self._last_tier_snapshot(hashes, own, min(end - 1, hit + loaded))
            except Exception as exc:
                self._warn("a lookup", 1, exc)
                break
            if end > own:
                _, state = self._load(self.spec.state_keys(hashes[end - 1]), [], self.spec.state_blocks)
        if state is None:
            manager.return_snapshot_row(row)
        else:
            self.scatter_state(row, state)
            manager.keep_snapshot(row, hashes[end - 1])
            self.stats.prefetched_states += 1
        self.stats.prefetch_seconds += time.perf_counter() - start
        return loaded

    def _last_tier_snapshot(self, hashes: list[bytes], after: int, upto: int) -> int:
        """The furthest block boundary in ``(after, upto]`` whose snapshot the tier holds whole,
        or ``after``."""
        end = upto
        while end > after and self.tier.lookup(self.spec.state_keys(hashes[end - 1])) < self.spec.state_blocks:
            end -= 1
        return max(end, after)

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
