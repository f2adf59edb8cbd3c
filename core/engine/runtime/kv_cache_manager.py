"""Paged KV-cache blocks with reference counts and prefix caching.

Every full block of a request's tokens gets a chained hash: the hash of the
previous block, the block's token ids, and (for the first block) a digest of
everything else that shapes the KV (model, dtype, block size). A block whose
hash is known can be shared by any request whose tokens hash the same way.

Blocks with no owner stay in an LRU free queue; those with a hash remain
reusable as prefix hits until allocation evicts them. Where it costs no cached
block, a request's blocks are placed one after another in memory (the block after
its last when that one is free and holds nothing; a new request where it has room
to grow, behind the requests placed before it): attention then streams each
request's KV as one run, which the CPU's prefetchers read faster than scattered
blocks. All layer groups of the
model share this block numbering: a request's block ``i`` holds its tokens
``i*block_size .. (i+1)*block_size-1`` in every group's cache tensor.

Recurrent layers (linear attention) keep one state per request instead of blocks, so a
cached prefix needs that state as it was at the prefix's end. With ``num_state_snapshots``
the manager keeps copies of it, in rows of the recurrent caches past the requests' slots,
each keyed by the hash of the block its tokens end with: at every ``snapshot_interval``
tokens, and at the last full block of each prompt (:meth:`snapshot_points`). Prompts are
computed in chunks that end at those points (:meth:`chunk_end`), so that the state exists
there; a prefix hit is cut back to its longest run of blocks whose last has a snapshot,
which is copied into the request's slot before its first step. A snapshot goes when its
block is evicted, or when a newer one needs its row (least recently used first); with a KV
tier it goes there (:meth:`take_evicted_states`), and snapshots the tier gives back take a
row like new ones (:meth:`take_snapshot_row`).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from engine.runtime.request import Request


def block_hash(parent: bytes, token_ids: list[int]) -> bytes:
    """hash(parent, tokens): 16 bytes."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.digest()


def cache_salt(*parts: object) -> bytes:
    """The root of every hash chain: a digest of what makes KV from the same tokens differ."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass
class SnapshotStats:
    taken: int = 0  # recurrent states copied into a snapshot row
    restored: int = 0  # prefix hits that started from a snapshot
    cut_tokens: int = 0  # cached tokens a hit gave up because no snapshot ended there
    dropped: int = 0  # snapshots whose block was evicted, or whose row a newer one took


class KVCacheManager:
    """Owns block allocation: ``request.block_ids`` is the request's block table."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        salt: bytes = b"",
        num_state_slots: int = 0,
        num_state_snapshots: int = 0,
        snapshot_interval: int = 0,
    ) -> None:
        """``num_state_slots``: recurrent-state slots (models with linear attention), one taken by
        each request from its first allocation until :meth:`free`; ``num_state_snapshots`` rows
        after them (``num_state_slots ..``) hold snapshots for prefix caching, taken every
        ``snapshot_interval`` tokens (a multiple of ``block_size``)."""
        if num_blocks < 1:
            raise ValueError(f"The KV cache needs at least one block, got {num_blocks}.")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.salt = salt
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> block id
        self.cache_generation = 0  # advanced by reset_prefix_cache: requests' published_blocks are stale
        # blocks nobody holds, least recently used first; popping the front evicts
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._cursor = 0  # where the next request's table starts, when that block is free (_take_block)
        self.stats = PrefixCacheStats()
        # with a KV tier: (block, hash) of every cached block evicted since take_evicted(), and
        # (hash, row) of every snapshot dropped since take_evicted_states() (its row still intact)
        self.record_evictions = False
        self.evicted: list[tuple[int, bytes]] = []
        self.evicted_states: list[tuple[bytes, int]] = []
        self.num_state_slots = num_state_slots
        self.free_state_slots = list(range(num_state_slots - 1, -1, -1))  # popped from the end: lowest first
        if num_state_snapshots and (snapshot_interval < 1 or snapshot_interval % block_size):
            raise ValueError(
                f"state_snapshot_interval must be a positive multiple of block_size ({block_size}), "
                f"got {snapshot_interval}."
            )
        self.num_state_snapshots = num_state_snapshots if enable_prefix_caching and num_state_slots else 0
        self.snapshot_interval = snapshot_interval
        self.snapshots: dict[bytes, int] = {}  # block hash -> the row holding the state after that block
        self.snapshot_hashes: dict[int, bytes] = {}  # row -> its hash, for the rows holding one
        # rows no pending copy writes, least recently used first: empty ones, then snapshots
        self.snapshot_rows: OrderedDict[int, None] = OrderedDict(
            (num_state_slots + r, None) for r in range(self.num_state_snapshots)
        )
        self.snapshot_stats = SnapshotStats()

    # queries

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Share of blocks held by requests."""
        return 1.0 - len(self.free_queue) / self.num_blocks

    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        total = request.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(request.block_ids))

    # prefix cache

    def update_hashes(self, request: Request, num_tokens: int | None = None) -> None:
        """Extend ``request.block_hashes`` over every full block of its first ``num_tokens`` tokens."""
        limit = request.num_tokens if num_tokens is None else num_tokens
        hashes = request.block_hashes
        bs = self.block_size
        while (len(hashes) + 1) * bs <= limit:
            start = len(hashes) * bs
            hashes.append(block_hash(hashes[-1] if hashes else self.salt, request.token_ids[start : start + bs]))

    def prefix_hashes(self, request: Request) -> list[bytes]:
        """The hashes of the full blocks a prefix hit may cover: all but the block holding the
        last token, which must be computed to produce the next token's logits."""
        self.update_hashes(request)
        return request.block_hashes[: (request.num_tokens - 1) // self.block_size]

    def leading_cached(self, hashes: list[bytes]) -> list[int]:
        """The cached blocks of the leading run of ``hashes`` found in the cache."""
        hits = []
        for h in hashes:
            block = self.cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Blocks holding the longest cached prefix of ``request``'s tokens.

        At least one token is always left to compute, since the step that
        computes it produces the next token's logits.
        """
        if not self.enable_prefix_caching or request.needs_prompt_logits:
            return []
        hashes = self.prefix_hashes(request)
        hits = self.leading_cached(hashes)
        if self.num_state_slots:  # recurrent layers: only as far as a snapshot of their state reaches
            if not self.num_state_snapshots:
                return []
            keep = len(hits)
            while keep and hashes[keep - 1] not in self.snapshots:
                keep -= 1
            self.snapshot_stats.cut_tokens += (len(hits) - keep) * self.block_size
            hits = hits[:keep]
        self.stats.queries += request.num_tokens
        self.stats.hits += len(hits) * self.block_size
        return hits

    # recurrent-state snapshots

    def snapshot_points(self, request: Request) -> tuple[int, int]:
        """(interval, prompt end): the token counts after which ``request``'s state is kept, every
        multiple of the interval and the last full block of its prompt (0 when it has none)."""
        last = (request.num_prompt_tokens - 1) // self.block_size * self.block_size
        return self.snapshot_interval, last

    def chunk_end(self, request: Request, start: int, num_new: int) -> int:
        """How many of the ``num_new`` tokens from ``start`` to compute this step: up to the first
        snapshot point after ``start`` (prompts are cut there, so that the state exists there)."""
        if not self.num_state_snapshots or num_new <= 1:
            return num_new
        interval, last = self.snapshot_points(request)
        stop = (start // interval + 1) * interval
        if start < last < stop:
            stop = last
        return min(num_new, stop - start)

    def plan_snapshot(self, request: Request, end: int) -> tuple[int, bytes] | None:
        """(row, hash) to copy ``request``'s state into after a step that leaves it at ``end``
        tokens, when ``end`` is a snapshot point not kept yet; the row is held until
        :meth:`publish_snapshot` (the copy runs after the step's forward)."""
        if not self.num_state_snapshots or end < self.block_size or end % self.block_size:
            return None
        interval, last = self.snapshot_points(request)
        if end % interval and end != last:
            return None
        if end > len(request.token_ids):  # a token still being sampled (scheduled ahead)
            return None
        self.update_hashes(request, end)
        h = request.block_hashes[end // self.block_size - 1]
        if h in self.snapshots or not self.snapshot_rows:
            return None
        row, _ = self.snapshot_rows.popitem(last=False)
        self._drop_snapshot(row)
        return row, h

    def publish_snapshot(self, row: int, h: bytes) -> None:
        """The copy into ``row`` ran: it now restores prefixes ending with block ``h``, if that
        block is still cached (else the row is free again)."""
        self.snapshot_stats.taken += 1
        self.keep_snapshot(row, h)

    def keep_snapshot(self, row: int, h: bytes) -> None:
        """``row`` (from :meth:`plan_snapshot` or :meth:`take_snapshot_row`) holds the state after
        block ``h``: it restores prefixes ending with that block if it is still cached (else the
        row is free again)."""
        if h in self.cached and h not in self.snapshots:
            self.snapshots[h] = row
            self.snapshot_hashes[row] = h
            self.snapshot_rows[row] = None
        else:
            self.snapshot_rows[row] = None
            self.snapshot_rows.move_to_end(row, last=False)

    def restore_row(self, request: Request, num_blocks: int) -> int:
        """The row holding the state after ``request``'s first ``num_blocks`` blocks (a prefix hit
        :meth:`find_cached_prefix` gave), now the most recently used."""
        row = self.snapshots[request.block_hashes[num_blocks - 1]]
        self.snapshot_rows.move_to_end(row)
        self.snapshot_stats.restored += 1
        return row

    def _drop_snapshot(self, row: int) -> None:
        h = self.snapshot_hashes.pop(row, None)
        if h is not None:
            del self.snapshots[h]
            self.snapshot_stats.dropped += 1
            if self.record_evictions:
                self.evicted_states.append((h, row))

    # allocation

    def allocate(self, request: Request, num_new_tokens: int, cached_blocks: list[int] | None = None) -> bool:
        """Room for ``num_new_tokens`` more tokens, after taking ``cached_blocks`` as the
        request's (empty) table's prefix. Returns False, changing nothing, if out of blocks."""
        cached_blocks = cached_blocks or []
        if cached_blocks:
            assert not request.block_ids and request.num_computed_tokens == 0
            num_cached_tokens = len(cached_blocks) * self.block_size
        else:
            num_cached_tokens = request.num_computed_tokens
        total = num_cached_tokens + num_new_tokens
        num_new_blocks = max(0, -(-total // self.block_size) - len(request.block_ids) - len(cached_blocks))
        reclaimed = sum(1 for b in cached_blocks if self.ref_counts[b] == 0)
        if num_new_blocks > len(self.free_queue) - reclaimed:
            return False
        if self.num_state_slots and request.state_slot is None:
            if not self.free_state_slots:
                return False
            request.state_slot = self.free_state_slots.pop()
        for block in cached_blocks:
            if self.ref_counts[block] == 0:
                del self.free_queue[block]
            self.ref_counts[block] += 1
        request.block_ids.extend(cached_blocks)
        request.num_computed_tokens = num_cached_tokens
        for _ in range(num_new_blocks):
            block = self._take_block(request)
            self.ref_counts[block] = 1
            request.block_ids.append(block)
        if self.enable_prefix_caching:
            # a block is published once its tokens are known (async scheduling runs ahead of them)
            self._cache_full_blocks(request, min(total, request.num_tokens))
        return True

    def allocate_lookahead(self, request: Request, num_tokens: int) -> bool:
        """Room for ``num_tokens`` draft tokens after what ``allocate`` made room for this
        step (``request.num_tokens``): they are written this step and may be rejected, so
        nothing is published to the prefix cache. False, changing nothing, if out of blocks."""
        total = request.num_tokens + num_tokens
        num_new_blocks = max(0, -(-total // self.block_size) - len(request.block_ids))
        if num_new_blocks > len(self.free_queue):
            return False
        for _ in range(num_new_blocks):
            block = self._take_block(request)
            self.ref_counts[block] = 1
            request.block_ids.append(block)
        return True

    def _take_block(self, request: Request) -> int:
        """A free block for the next entry of ``request``'s table: the block after its last one,
        or for a new table the one at the placement cursor, when that block is free and holds
        no cached KV (taking it evicts nothing); otherwise the front of the free queue."""
        if request.block_ids:
            wanted = request.block_ids[-1] + 1
        else:
            # room for the whole request behind this start, so that its later blocks follow it
            span = -(-(request.num_tokens + (request.sampling_params.max_tokens or 0)) // self.block_size)
            if self._cursor + span > self.num_blocks:
                self._cursor = 0
            wanted, self._cursor = self._cursor, self._cursor + span
        if wanted < self.num_blocks and self.block_hashes[wanted] is None and wanted in self.free_queue:
            del self.free_queue[wanted]
            return wanted
        block, _ = self.free_queue.popitem(last=False)
        self._evict(block)
        return block

    def trim(self, request: Request) -> None:
        """Free the request's blocks beyond those its tokens need (taken for drafts that
        were rejected): they hold nothing and are the first to be reused."""
        keep = -(-request.num_tokens // self.block_size)
        extra = request.block_ids[keep:]
        if extra:
            del request.block_ids[keep:]
            for block in extra:
                self.ref_counts[block] = 0
            self.return_free_blocks(extra)

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        # the blocks this step fills will hold valid KV once it runs: publish them. A leading run
        # of published blocks stays published while the request holds them (only free blocks are
        # evicted), so each step starts after it instead of at the first block
        self.update_hashes(request, num_tokens)
        generation, start = request.published_blocks
        if generation != self.cache_generation:
            start = 0
        leading = True
        for i in range(start, num_tokens // self.block_size):
            block = request.block_ids[i]
            if self.block_hashes[block] is None:
                h = request.block_hashes[i]
                if h in self.cached:  # the same content computed twice concurrently: keep the first
                    leading = False  # tried again next step: the first may be evicted meanwhile
                    continue
                self.block_hashes[block] = h
                self.cached[h] = block
            if leading:
                start = i + 1
        request.published_blocks = (self.cache_generation, start)

    def _evict(self, block: int) -> None:
        h = self.block_hashes[block]
        if h is not None:
            self.block_hashes[block] = None
            if self.cached.get(h) == block:
                del self.cached[h]
                row = self.snapshots.get(h)
                if row is not None:  # no hit can reach it without its block
                    self._drop_snapshot(row)
                    self.snapshot_rows.move_to_end(row, last=False)
                if self.record_evictions:
                    self.evicted.append((block, h))

    # secondary tier support (KVTierConnector)

    def take_evicted(self) -> list[tuple[int, bytes]]:
        evicted, self.evicted = self.evicted, []
        return evicted

    def take_evicted_states(self) -> list[tuple[bytes, int]]:
        """(hash, row) of the snapshots dropped since the last call; each row holds its state until
        the next step's forward or :meth:`take_snapshot_row` reuses it."""
        evicted, self.evicted_states = self.evicted_states, []
        return evicted

    def take_snapshot_row(self) -> int | None:
        """A snapshot row to fill (the least recently used, its snapshot dropped), held until
        :meth:`keep_snapshot` or :meth:`return_snapshot_row`; None without snapshot rows."""
        if not self.snapshot_rows:
            return None
        row, _ = self.snapshot_rows.popitem(last=False)
        self._drop_snapshot(row)
        return row

    def return_snapshot_row(self, row: int) -> None:
        """A row :meth:`take_snapshot_row` gave that was not filled: free, first to be reused."""
        self.snapshot_rows[row] = None
        self.snapshot_rows.move_to_end(row, last=False)

    def protect(self, hashes: list[bytes]) -> int:
        """Move the free cached blocks of ``hashes``, and the rows of their snapshots, to the back of
        the eviction order; returns how many of the blocks are free (they must not be taken by
        :meth:`take_free_blocks`)."""
        free = 0
        for h in hashes:
            row = self.snapshots.get(h)
            if row is not None:
                self.snapshot_rows.move_to_end(row)
            block = self.cached.get(h)
            if block is not None and self.ref_counts[block] == 0:
                self.free_queue.move_to_end(block)
                free += 1
        return free

    def take_free_blocks(self, n: int) -> list[int]:
        """Take ``n`` blocks from the front of the free queue (evicting their hashes), owned by
        nobody until :meth:`publish_loaded` or :meth:`return_free_blocks`."""
        blocks = []
        for _ in range(n):
            block, _ = self.free_queue.popitem(last=False)
            self._evict(block)
            blocks.append(block)
        return blocks

    def publish_loaded(self, blocks: list[int], hashes: list[bytes]) -> None:
        """Blocks now holding the KV of ``hashes``: cached and free, most recently used."""
        for block, h in zip(blocks, hashes, strict=True):
            if h in self.cached:  # loaded twice meanwhile: keep the first, this block stays plain
                self.free_queue[block] = None
                self.free_queue.move_to_end(block, last=False)
                continue
            self.block_hashes[block] = h
            self.cached[h] = block
            self.free_queue[block] = None

    def return_free_blocks(self, blocks: list[int]) -> None:
        """Blocks taken but not filled: free, first to be reused."""
        for block in reversed(blocks):
            self.free_queue[block] = None
            self.free_queue.move_to_end(block, last=False)

    def free(self, request: Request) -> None:
        """Drop the request's hold on its blocks. Unshared tail blocks become the
        first to evict; cached blocks stay reusable until evicted."""
        for block in reversed(request.block_ids):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_queue[block] = None
                if self.block_hashes[block] is None:
                    self.free_queue.move_to_end(block, last=False)
        request.block_ids = []
        request.published_blocks = (self.cache_generation, 0)
        if request.state_slot is not None:  # a preempted request recomputes from a fresh state
            self.free_state_slots.append(request.state_slot)
            request.state_slot = None

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks in use keep their contents)."""
        self.cached.clear()
        self.block_hashes = [None] * self.num_blocks
        self.cache_generation += 1
        for row in list(self.snapshot_hashes):
            self._drop_snapshot(row)
