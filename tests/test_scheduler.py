"""Scheduler and block pool behaviour with hand-checked cases."""

from __future__ import annotations

import pytest

from engine.runtime.kv_cache_manager import KVCacheManager
from engine.runtime.request import Request, RequestStatus
from engine.runtime.scheduler import Scheduler
from engine.sampling_params import SamplingParams


def req(rid: str, n: int, priority: int = 0) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=100), priority=priority)


def advance(scheduler: Scheduler, batch, sample_token: int = 7) -> None:
    """What the engine does after a step: count computed tokens, append a token when sampled."""
    for request, n in zip(batch.requests, batch.num_tokens):
        request.num_computed_tokens += n
        if request.num_computed_tokens == request.num_tokens:
            request.append_token(sample_token)


def test_manager_allocates_ceil_blocks_and_frees():
    pool = KVCacheManager(10, 4, enable_prefix_caching=False)
    r = req("a", 9)
    assert pool.allocate(r, 9) and len(r.block_ids) == 3
    r.num_computed_tokens = 9
    assert pool.allocate(r, 3) and len(r.block_ids) == 3  # 12 tokens still fit in 3 blocks
    assert pool.allocate(r, 4) and len(r.block_ids) == 4
    assert pool.num_free_blocks == 6
    assert not pool.allocate(req("b", 100), 100)
    pool.free(r)
    assert pool.num_free_blocks == 10 and r.block_ids == []


def test_manager_places_each_table_in_one_run_of_blocks_with_room_to_grow():
    pool = KVCacheManager(64, 4, enable_prefix_caching=False)
    a = Request("a", list(range(1, 10)), SamplingParams(max_tokens=8))  # 17 tokens at most: 5 blocks
    b = Request("b", list(range(1, 6)), SamplingParams(max_tokens=3))  # 8 tokens: 2 blocks
    assert pool.allocate(a, 9) and pool.allocate(b, 5)
    assert a.block_ids == [0, 1, 2] and b.block_ids == [5, 6]  # b starts after a's 5 blocks
    a.num_computed_tokens = 9
    assert pool.allocate(a, 8) and a.block_ids == [0, 1, 2, 3, 4]  # a grows into its own run
    # past its run, the next block is b's: a's comes from the free queue's front instead
    a.num_computed_tokens = 17
    assert pool.allocate(a, 4) and a.block_ids == [0, 1, 2, 3, 4, 7]
    d = Request("d", [1, 2, 3, 4], SamplingParams(max_tokens=1))  # its start, block 7, is a's now
    assert pool.allocate(d, 4) and d.block_ids == [8]
    for r in (a, b, d):
        pool.free(r)
    assert pool.num_free_blocks == 64


def test_manager_placement_never_evicts_a_cached_block():
    pool = KVCacheManager(16, 4, enable_prefix_caching=True)
    a = Request("a", list(range(1, 9)), SamplingParams(max_tokens=1))  # two full blocks, both cached
    assert pool.allocate(a, 8) and a.block_ids == [0, 1]
    a_hashes = [pool.block_hashes[0], pool.block_hashes[1]]
    pool.free(a)  # blocks 0 and 1 stay cached, free, at the back of the queue
    b = Request("b", list(range(100, 105)), SamplingParams(max_tokens=100))  # no room: the cursor wraps to 0
    assert pool.allocate(b, 5) and b.block_ids == [2, 3]  # block 0 is cached: the front of the queue instead
    assert all(pool.cached.get(h) == i for i, h in enumerate(a_hashes))
    # with every other block taken, the cached ones are evicted from the queue's front as before
    c = Request("c", list(range(200, 200 + 4 * 14)), SamplingParams(max_tokens=1))
    assert pool.allocate(c, 4 * 14) and sorted(b.block_ids + c.block_ids) == list(range(16))
    assert c.block_ids[-2:] == [1, 0] and not any(h in pool.cached for h in a_hashes)


def test_chunked_prefill_under_the_token_budget_and_decode_first():
    scheduler = Scheduler(
        KVCacheManager(100, 4, enable_prefix_caching=False), max_num_seqs=8, max_num_batched_tokens=10
    )
    a, b = req("a", 6), req("b", 15)
    scheduler.add(a)
    scheduler.add(b)
    batch = scheduler.schedule()
    assert [r.request_id for r in batch.requests] == ["a", "b"] and batch.num_tokens == [6, 4]
    advance(scheduler, batch)
    batch = scheduler.schedule()  # a decodes first, b continues its prefill with the rest of the budget
    assert [r.request_id for r in batch.requests] == ["a", "b"] and batch.num_tokens == [1, 9]
    advance(scheduler, batch)
    batch = scheduler.schedule()
    assert batch.num_tokens == [1, 2]


def test_priority_orders_admission():
    scheduler = Scheduler(
        KVCacheManager(100, 4, enable_prefix_caching=False), max_num_seqs=1, max_num_batched_tokens=100
    )
    scheduler.add(req("late-low", 4, priority=5))
    scheduler.add(req("urgent", 4, priority=-1))
    scheduler.add(req("normal", 4, priority=0))
    assert [r.request_id for r in scheduler.waiting] == ["urgent", "normal", "late-low"]
    assert scheduler.schedule().requests[0].request_id == "urgent"


def test_preemption_by_recompute_when_blocks_run_out():
    pool = KVCacheManager(4, 4, enable_prefix_caching=False)
    scheduler = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=100)
    a, b = req("a", 8), req("b", 7)
    scheduler.add(a)
    scheduler.add(b)
    batch = scheduler.schedule()
    assert batch.num_tokens == [8, 7] and pool.num_free_blocks == 0
    advance(scheduler, batch)
    # a needs a third block for its 9th token: b (admitted later) is preempted
    batch = scheduler.schedule()
    assert [r.request_id for r in batch.requests] == ["a"]
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0 and b.block_ids == []
    assert b.token_ids[-1] == 7 and b.num_tokens == 8  # its sampled token is kept for the recompute
    assert scheduler.num_preemptions == 1


def test_finish_frees_blocks():
    pool = KVCacheManager(8, 4, enable_prefix_caching=False)
    scheduler = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=100)
    a = req("a", 9)
    scheduler.add(a)
    scheduler.schedule()
    scheduler.finish(a, RequestStatus.FINISHED_ABORTED)
    assert pool.num_free_blocks == 8 and not scheduler.has_unfinished()


def test_request_too_large_for_the_cache_is_a_clear_error():
    scheduler = Scheduler(KVCacheManager(2, 4, enable_prefix_caching=False), max_num_seqs=8, max_num_batched_tokens=100)
    scheduler.add(req("huge", 20))
    with pytest.raises(RuntimeError, match="kv-cache-memory"):
        scheduler.schedule()


def grouped(rid: str, group: str | None, n: int = 4) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=100), group=group)


def test_a_small_client_request_is_admitted_before_the_rest_of_a_big_one():
    """Fair admission: seats go to the group with the fewest running sequences first."""
    scheduler = Scheduler(KVCacheManager(200, 4, enable_prefix_caching=False), max_num_seqs=4, max_num_batched_tokens=8)
    for i in range(6):
        scheduler.add(grouped(f"big-{i}", "big"))
    scheduler.add(grouped("small", "small"))
    batch = scheduler.schedule()  # the budget of 8 admits two: big-0, then the group with no seat
    assert [r.request_id for r in batch.requests] == ["big-0", "small"]
    advance(scheduler, batch)
    batch = scheduler.schedule()
    assert [r.request_id for r in batch.requests] == ["big-0", "small", "big-1", "big-2"]


def test_a_new_client_request_takes_a_seat_from_the_group_holding_them_all():
    scheduler = Scheduler(
        KVCacheManager(200, 4, enable_prefix_caching=False), max_num_seqs=4, max_num_batched_tokens=100
    )
    for i in range(10):
        scheduler.add(grouped(f"big-{i}", "big"))
    advance(scheduler, scheduler.schedule())
    assert [r.request_id for r in scheduler.running] == ["big-0", "big-1", "big-2", "big-3"]
    scheduler.add(grouped("small", "small"))
    batch = scheduler.schedule()
    assert "small" in [r.request_id for r in batch.requests] and scheduler.num_preemptions == 1
    assert sorted(r.request_id for r in scheduler.running) == ["big-0", "big-1", "big-2", "small"]
    assert scheduler.waiting[0].request_id == "big-3"  # preempted, first in line again, to recompute
    advance(scheduler, batch)
    scheduler.schedule()  # the small group holds a seat now: nothing more is taken
    assert scheduler.num_preemptions == 1


def test_requests_without_a_group_are_never_preempted_for_fairness():
    scheduler = Scheduler(
        KVCacheManager(200, 4, enable_prefix_caching=False), max_num_seqs=2, max_num_batched_tokens=100
    )
    for i in range(4):
        scheduler.add(grouped(f"r{i}", None))
    advance(scheduler, scheduler.schedule())
    advance(scheduler, scheduler.schedule())
    assert scheduler.num_preemptions == 0 and [r.request_id for r in scheduler.running] == ["r0", "r1"]
