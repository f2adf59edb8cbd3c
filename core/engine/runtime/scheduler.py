"""Continuous batching under a per-step token budget, with chunked prefill and
preemption by recompute."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.runtime.kv_cache_manager import KVCacheManager
from engine.runtime.request import Request, RequestStatus


@dataclass
class ScheduledBatch:
    """What runs this step: ``requests[i]`` computes ``num_tokens[i]`` new tokens, then
    the speculative drafts ``drafts[i]`` (set after scheduling, for decoding requests;
    ``draft_probs[i]`` the proposer's probabilities of them, or None)."""

    requests: list[Request] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    drafts: dict[int, list[int]] = field(default_factory=dict)
    draft_probs: dict[int, object] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens) + sum(len(d) for d in self.drafts.values())


class Scheduler:
    def __init__(self, kv_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.kv_manager = kv_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Request] = []  # kept sorted by sort_key
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)
        self.waiting.sort(key=lambda r: r.sort_key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        # decode, and the next chunk of running prefills, in priority order
        self.running.sort(key=lambda r: r.sort_key)
        for request in list(self.running):
            if budget == 0:
                break
            if request not in self.running:  # preempted below to make room
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv_manager.allocate(request, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is request:
                    break
            else:
                batch.requests.append(request)
                batch.num_tokens.append(num_new)
                budget -= num_new
        # prefill: admit waiting requests while blocks, budget and seats last
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            # prefix cache: start after the longest run of cached blocks
            cached_blocks = self.kv_manager.find_cached_prefix(request) if request.num_computed_tokens == 0 else []
            num_cached = len(cached_blocks) * self.kv_manager.block_size
            num_new = min(request.num_tokens - request.num_computed_tokens - num_cached, budget)
            if not self.kv_manager.allocate(request, num_new, cached_blocks):
                if not self.running and self.kv_manager.blocks_needed(request, 1) > self.kv_manager.num_blocks:
                    raise RuntimeError(
                        f"Request {request.request_id!r} needs more KV-cache blocks than the cache has "
                        f"({self.kv_manager.num_blocks}); raise --kv-cache-memory or lower --max-model-len."
                    )
                break
            self.waiting.pop(0)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            batch.requests.append(request)
            batch.num_tokens.append(num_new)
            budget -= num_new
        if not batch.requests and self.has_unfinished():
            raise RuntimeError(
                f"Nothing can be scheduled: the KV cache ({self.kv_manager.num_blocks} blocks of "
                f"{self.kv_manager.block_size} tokens) cannot hold the next request. Raise --kv-cache-memory."
            )
        return batch

    def _preempt(self, request: Request) -> None:
        # recompute on resumption: drop the cache, keep the tokens
        self.running.remove(request)
        self.kv_manager.free(request)
        request.num_computed_tokens = 0
        self.num_preemptions += 1
        self.add(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv_manager.free(request)
