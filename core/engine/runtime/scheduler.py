"""Continuous batching under a per-step token budget, with chunked prefill and
preemption by recompute. The scheduler is the one writer of request progress: it
admits, allocates KV blocks (speculative drafts too), and advances each request from
the step's output (``update_from_output``)."""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable
from typing import Protocol

from engine.runtime.batch import ModelOutput, ScheduledBatch
from engine.runtime.kv_cache_manager import KVCacheManager
from engine.runtime.reasoning import may_force, next_token, release_constraint
from engine.runtime.request import Request, RequestStatus
from engine.runtime.structured_output import advance, valid_drafts

__all__ = ["DraftPlanner", "ScheduledBatch", "Scheduler", "StopCheck"]

# (request, the status its newest token gives it, or None) -> the status it finishes with, or None;
# the output processor's text checks (stop strings) run through it, token by token
StopCheck = Callable[[Request, "RequestStatus | None"], "RequestStatus | None"]


class DraftPlanner(Protocol):
    """What the scheduler asks of speculative decoding (``engine.spec_decode.decoder.SpecDecoder``)."""

    def propose(self, batch: ScheduledBatch) -> list[tuple[int, list[int], object | None]]:
        """(index in the batch, drafts, their probabilities or None) for decoding requests."""

    def record(self, request: Request, num_drafts: int, accepted: int) -> int:
        """After verification: how many drafts were kept."""

    def record_step(self, num_tokens: int, seconds: float, decode_only: bool) -> None:
        """The step's size and duration."""

    def remove(self, request_ids: list[str]) -> None:
        """Forget finished requests."""


def _no_text_check(request: Request, status: RequestStatus | None) -> RequestStatus | None:
    return status


class Scheduler:
    def __init__(
        self,
        kv_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        *,
        max_model_len: int = 2**62,
        spec: DraftPlanner | None = None,
    ) -> None:
        self.kv_manager = kv_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.spec = spec  # speculative decoding: drafts planned into each batch
        self.waiting: list[Request] = []  # kept sorted by sort_key
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_scheduled_ahead = 0  # batches scheduled while the step before still ran
        self._arrivals = itertools.count()  # first come, first served within a priority
        self._step_started = 0.0

    def add(self, request: Request) -> None:
        if request.arrival_order is None:  # a preempted request keeps its place
            request.arrival_order = next(self._arrivals)
        request.status = RequestStatus.WAITING
        self.waiting.append(request)
        self.waiting.sort(key=lambda r: r.sort_key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # schedule

    def schedule(self) -> ScheduledBatch:
        self._step_started = time.perf_counter()
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        self._free_a_seat_for_a_new_group()
        # decode, and the next chunk of running prefills, in priority order
        self.running.sort(key=lambda r: r.sort_key)
        for request in list(self.running):
            if budget == 0:
                break
            if request not in self.running:  # preempted below to make room
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            num_new = self.kv_manager.chunk_end(request, request.num_computed_tokens, num_new)
            while not self.kv_manager.allocate(request, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is request:
                    break
            else:
                batch.requests.append(request)
                batch.num_tokens.append(num_new)
                budget -= num_new
        # prefill: admit waiting requests while blocks, budget and seats last, fairly between groups
        room = self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
        admission = _FairAdmission(self.waiting, self.running) if room else None
        admitted: set[int] = set()
        while admission and budget > 0 and len(self.running) < self.max_num_seqs:
            request = admission.pop()
            # prefix cache: start after the longest run of cached blocks
            cached_blocks = self.kv_manager.find_cached_prefix(request) if request.num_computed_tokens == 0 else []
            num_cached = len(cached_blocks) * self.kv_manager.block_size
            num_new = min(request.num_tokens - request.num_computed_tokens - num_cached, budget)
            num_new = self.kv_manager.chunk_end(request, request.num_computed_tokens + num_cached, num_new)
            # with cached blocks, allocate takes them as the request's computed prefix
            if not self.kv_manager.allocate(request, num_new, cached_blocks):
                if not self.running and self.kv_manager.blocks_needed(request, 1) > self.kv_manager.num_blocks:
                    raise RuntimeError(
                        f"Request {request.request_id!r} needs more KV-cache blocks than the cache has "
                        f"({self.kv_manager.num_blocks}); raise --kv-cache-memory or lower --max-model-len."
                    )
                break
            if cached_blocks and request.state_slot is not None:  # its recurrent state from the snapshot
                batch.state_restores.append(
                    (self.kv_manager.restore_row(request, len(cached_blocks)), request.state_slot)
                )
            admitted.add(id(request))
            admission.admitted(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            batch.requests.append(request)
            batch.num_tokens.append(num_new)
            budget -= num_new
        if admitted:
            self.waiting = [r for r in self.waiting if id(r) not in admitted]
        if not batch.requests and self.has_unfinished():
            raise RuntimeError(
                f"Nothing can be scheduled: the KV cache ({self.kv_manager.num_blocks} blocks of "
                f"{self.kv_manager.block_size} tokens) cannot hold the next request. Raise --kv-cache-memory."
            )
        # a request samples when this step computes its newest token
        batch.sample_indices = [
            i
            for i, (request, n) in enumerate(zip(batch.requests, batch.num_tokens))
            if request.num_computed_tokens + n == request.num_tokens
        ]
        if self.spec is not None and batch.requests:
            self._plan_drafts(batch)
        batch.snapshot()
        self._plan_state_snapshots(batch)
        return batch

    def schedule_ahead(self, running: ScheduledBatch) -> ScheduledBatch | None:
        """The next step's batch while ``running`` still runs (async scheduling): each request
        ``running`` samples for is taken to have one more token, which the runner fills in from
        that step's output (``PLACEHOLDER``). None when the next step depends on what only that
        step's outcome tells: requests waiting to be admitted, a preemption, speculation,
        penalties, a pending min_tokens, an output constraint or a thinking budget (their sampling
        reads the output), prompt logits;
        the engine then schedules after it."""
        if self.spec is not None or self.waiting:
            return None
        self._step_started = time.perf_counter()
        sampling = set(running.sample_indices)
        in_flight = {id(r): (n, i in sampling) for i, (r, n) in enumerate(zip(running.requests, running.num_tokens))}
        budget, plan = self.max_num_batched_tokens, []
        for request in sorted(self.running, key=lambda r: r.sort_key):
            params = request.sampling_params
            pending_min = params.min_tokens and request.num_output_tokens <= params.min_tokens
            if (
                params.has_penalties
                or pending_min
                or request.needs_prompt_logits
                or request.grammar is not None
                or may_force(request)
            ):
                return None
            computing, samples = in_flight.get(id(request), (0, False))
            computed, total = request.num_computed_tokens + computing, request.num_tokens + samples
            if samples and (total >= self.max_model_len or params.max_tokens == request.num_output_tokens + 1):
                continue  # the token it samples now is its last
            num_new = min(total - computed, budget)
            if num_new > 0:
                plan.append((request, computing, computed, num_new, total))
                budget -= num_new
        if not plan:
            return None
        batch = ScheduledBatch()
        for request, computing, _, num_new, _ in plan:
            if not self.kv_manager.allocate(request, computing + num_new):
                return None  # the blocks taken so far are ones those requests fill next
            batch.requests.append(request)
            batch.num_tokens.append(num_new)
        # a request samples when its new tokens reach its newest
        batch.sample_indices = [
            i for i, (_, _, computed, num_new, total) in enumerate(plan) if computed + num_new == total
        ]
        batch.snapshot([computed for _, _, computed, _, _ in plan])
        self._plan_state_snapshots(batch)
        self.num_scheduled_ahead += 1
        return batch

    def _plan_state_snapshots(self, batch: ScheduledBatch) -> None:
        """Recurrent models with prefix caching: the requests whose state this step leaves at a
        snapshot point, copied after the forward (not those with drafts: where their state ends
        depends on what is accepted)."""
        if not self.kv_manager.num_state_snapshots:
            return
        for i, (request, start, n) in enumerate(zip(batch.requests, batch.context_lens, batch.num_tokens)):
            if i not in batch.drafts:
                planned = self.kv_manager.plan_snapshot(request, start + n)
                if planned is not None:
                    batch.state_saves.append((request.state_slot, *planned))

    def _plan_drafts(self, batch: ScheduledBatch) -> None:
        """Drafts the proposer made for decoding requests, each admitted while the step's
        token budget and the KV cache have room (their blocks are not published: they may
        be rejected)."""
        room = self.max_num_batched_tokens - batch.total_tokens
        for i, tokens, probs in self.spec.propose(batch):
            request = batch.requests[i]
            # drafts the output constraint allows; none where the engine may write the next token itself
            tokens = [] if may_force(request) else valid_drafts(request, tokens)
            count = min(len(tokens), room)
            if count and self.kv_manager.allocate_lookahead(request, count):
                batch.drafts[i] = tokens[:count]
                if probs is not None:
                    batch.draft_probs[i] = probs[:count]
                room -= count

    def _free_a_seat_for_a_new_group(self) -> None:
        """With every seat taken and a client request (an explicit ``group``) waiting with none of
        its own, preempt the newest sequence of the group holding the most seats (if it holds
        more than one, at no better priority): one client's batch cannot keep another out until
        its hundreds of sequences finish. One seat per step, and only for a group with no seat,
        so groups never trade seats back and forth."""
        if len(self.running) < self.max_num_seqs or not self.waiting:
            return
        seats: dict[str, int] = {}
        for request in self.running:
            seats[request.fair_group] = seats.get(request.fair_group, 0) + 1
        newcomer = next((r for r in self.waiting if r.group is not None and r.fair_group not in seats), None)
        if newcomer is None:
            return
        largest = max(seats, key=seats.__getitem__)
        if seats[largest] < 2:
            return
        victims = [r for r in self.running if r.fair_group == largest and r.priority >= newcomer.priority]
        if victims:
            self._preempt(max(victims, key=lambda r: r.arrival_order))

    def _preempt(self, request: Request) -> None:
        # recompute on resumption: drop the cache, keep the tokens
        self.running.remove(request)
        self.kv_manager.free(request)
        request.num_computed_tokens = 0
        self.num_preemptions += 1
        self.add(request)

    # update

    def update_from_output(
        self, batch: ScheduledBatch, output: ModelOutput, check: StopCheck = _no_text_check
    ) -> list[Request]:
        """Advance every request of ``batch`` by what the step computed and sampled: the
        scheduled tokens and accepted drafts count as computed, sampled tokens are appended
        one by one until one finishes the request (its stop conditions, then ``check``:
        the output processor's stop strings). Returns the requests that finished."""
        for request, n in zip(batch.requests, batch.num_tokens):
            if not request.status.finished:
                request.num_computed_tokens += n
        for _, row, h in batch.state_saves:  # the runner copied the states after the forward
            self.kv_manager.publish_snapshot(row, h)
        finished: list[Request] = []
        rejected: list[Request] = []
        for i, request, tokens in zip(batch.sample_indices, output.requests, output.tokens):
            if request.status.finished:  # aborted while the step ran (async execution)
                continue
            drafts = batch.drafts.get(i)
            if drafts:  # accepted drafts were computed with the right context: their KV stays
                accepted = self.spec.record(request, len(drafts), len(tokens) - 1)
                if request.request_id in output.rewound:
                    # its recurrent state is back to before the step: the step's token and the
                    # accepted drafts are recomputed next step, with the newly sampled token
                    request.num_computed_tokens -= batch.num_tokens[i]
                else:
                    request.num_computed_tokens += accepted
                if accepted < len(drafts):
                    rejected.append(request)
            for token in tokens:
                token = next_token(request, token)  # a thinking budget may close the reasoning here
                request.append_token(token)
                status = check(request, advance(request, token, request.check_stop(self.max_model_len)))
                release_constraint(request)
                if status is not None:
                    self.finish(request, status)
                    finished.append(request)
                    break
        for request in rejected:  # the blocks taken for rejected drafts hold nothing
            if not request.status.finished:
                self.kv_manager.trim(request)
        if self.spec is not None:
            self.spec.record_step(batch.total_tokens, time.perf_counter() - self._step_started, batch.decode_only)
        return finished

    def finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv_manager.free(request)
        if self.spec is not None:
            self.spec.remove([request.request_id])


class _FairAdmission:
    """The order in which one step admits waiting requests: by priority, then the group with
    the fewest running sequences (counting those admitted this step), then first come first
    served. Each group's waiting requests keep their own order."""

    def __init__(self, waiting: list[Request], running: list[Request]) -> None:
        self.seats: dict[str, int] = {}
        for request in running:
            self.seats[request.fair_group] = self.seats.get(request.fair_group, 0) + 1
        self.queues: dict[str, list[Request]] = {}
        for request in reversed(waiting):  # each queue's next request at its end
            self.queues.setdefault(request.fair_group, []).append(request)
        self.heap = [self._key(group, queue[-1]) for group, queue in self.queues.items()]
        heapq.heapify(self.heap)

    def _key(self, group: str, head: Request) -> tuple[int, int, int, str]:
        return (head.priority, self.seats.get(group, 0), head.arrival_order, group)

    def __bool__(self) -> bool:
        return bool(self.heap)

    def pop(self) -> Request:
        """The next request to try (stays next until :meth:`admitted` says it was taken)."""
        return self.queues[self.heap[0][3]][-1]

    def admitted(self, request: Request) -> None:
        group = heapq.heappop(self.heap)[3]
        queue = self.queues[group]
        queue.pop()
        self.seats[group] = self.seats.get(group, 0) + 1
        if queue:
            heapq.heappush(self.heap, self._key(group, queue[-1]))
