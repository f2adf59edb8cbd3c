"""Prefix caching of recurrent state (``KVCacheManager`` with state snapshots, and the
scheduler's use of them), hand-checked: where prompts are cut, which points are kept, how a
hit is cut back to a snapshot, and how snapshots are evicted."""

from __future__ import annotations

import pytest

from engine.runtime.batch import ModelOutput
from engine.runtime.kv_cache_manager import KVCacheManager
from engine.runtime.request import Request
from engine.runtime.scheduler import Scheduler
from engine.sampling_params import SamplingParams

BS = 4  # tokens per block
SLOTS = 2  # request state slots: snapshot rows are numbered from here


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=100))


def manager(snapshots: int = 3, interval: int = 8, blocks: int = 40) -> KVCacheManager:
    return KVCacheManager(blocks, BS, num_state_slots=SLOTS, num_state_snapshots=snapshots, snapshot_interval=interval)


def run_prompt(pool: KVCacheManager, request: Request, budget: int = 1000) -> list[int]:
    """Compute ``request``'s prompt chunk by chunk as the scheduler cuts it, taking every
    snapshot planned: the chunk lengths."""
    hits = pool.find_cached_prefix(request)
    chunks = []
    first = True
    while request.num_computed_tokens < request.num_tokens:
        start = request.num_computed_tokens + (len(hits) * BS if first else 0)
        n = pool.chunk_end(request, start, min(request.num_tokens - start, budget))
        assert pool.allocate(request, n, hits if first else None)
        first = False
        planned = pool.plan_snapshot(request, start + n)
        request.num_computed_tokens = start + n
        if planned is not None:
            pool.publish_snapshot(*planned)
        chunks.append(n)
    return chunks


def test_prompts_are_cut_at_every_interval_and_at_their_last_full_block():
    pool = manager()
    # 23 tokens: the interval's points 8 and 16, then the last full block before the newest token, 20
    assert run_prompt(pool, req("a", range(100, 123))) == [8, 8, 4, 3]
    assert pool.snapshot_stats.taken == 3
    # 21 tokens: its last full block ends at 20 (token 21 is computed for the logits)
    assert run_prompt(manager(), req("b", range(100, 121))) == [8, 8, 4, 1]
    # a step budget cuts as well: chunks of 5 stop at 8 and 16 on the way
    assert run_prompt(manager(), req("c", range(100, 118)), budget=5) == [5, 3, 5, 3, 2]


def test_one_token_steps_are_not_cut_and_decode_keeps_interval_points():
    pool = manager()
    r = req("a", range(100, 107))  # last full block: 4
    assert pool.chunk_end(r, 0, 1) == 1
    assert pool.chunk_end(r, 0, 7) == 4
    assert pool.plan_snapshot(r, 6) is None  # not a block boundary
    r.append_token(5)
    r.append_token(6)
    planned = pool.plan_snapshot(r, 8)  # a multiple of the interval, reached while decoding
    assert planned is not None and planned[0] == SLOTS  # the first snapshot row
    assert pool.plan_snapshot(r, 12) is None  # a block boundary, but neither point


def test_a_hit_is_cut_back_to_its_longest_snapshot():
    pool = manager()
    shared = list(range(100, 119))  # 19 tokens: snapshots at 8 and 16 (its last full block)
    run_prompt(pool, req("a", shared))
    b = req("b", shared[:14] + [7, 7, 7, 7, 7, 7])  # shares 3 full blocks (12 tokens)
    hits = pool.find_cached_prefix(b)
    assert len(hits) == 2  # 12 cached tokens, but the state is kept only at 8
    assert pool.snapshot_stats.cut_tokens == 4
    assert pool.allocate(b, b.num_tokens - 8, hits)
    row = pool.restore_row(b, len(hits))
    a_state_at_8 = pool.snapshots[b.block_hashes[1]]
    assert row == a_state_at_8 and b.num_computed_tokens == 8


def test_without_a_snapshot_a_recurrent_model_has_no_hit():
    pool = manager(snapshots=0)
    run_prompt(pool, req("a", range(100, 130)))
    assert pool.find_cached_prefix(req("b", range(100, 130))) == []
    assert pool.num_state_snapshots == 0 and not pool.snapshots


def test_evicting_a_block_drops_its_snapshot_and_rows_go_least_recently_used_first():
    pool = manager(snapshots=2, blocks=8)
    a = req("a", range(100, 117))  # snapshots at 8 and 16
    run_prompt(pool, a)
    rows = dict(pool.snapshot_hashes)
    assert sorted(rows) == [SLOTS, SLOTS + 1]
    pool.free(a)
    # a new prompt needs every block: the evicted blocks take their snapshots with them
    b = req("b", range(200, 229))
    hits = pool.find_cached_prefix(b)
    assert hits == [] and pool.allocate(b, 29)
    assert pool.snapshots == {} and pool.snapshot_stats.dropped == 2
    # a full pool hands out its least recently used row
    pool = manager(snapshots=2)
    run_prompt(pool, req("c", range(300, 317)))  # rows SLOTS (at 8) and SLOTS + 1 (at 16)
    d = req("d", list(range(300, 308)) + [1, 2, 3])  # hits the snapshot at 8
    hits = pool.find_cached_prefix(d)
    assert pool.allocate(d, 3, hits) and pool.restore_row(d, len(hits)) == SLOTS  # now the most recent
    pool.free(d)
    e = req("e", range(400, 409))
    assert pool.allocate(e, 9)
    planned = pool.plan_snapshot(e, 8)
    assert planned is not None and planned[0] == SLOTS + 1  # the one at 16, used least recently
    assert pool.snapshot_stats.dropped == 1


def test_a_pending_row_is_not_handed_out_twice_and_a_late_publish_frees_it():
    pool = manager(snapshots=1)
    a = req("a", range(100, 109))
    assert pool.allocate(a, 8)
    planned = pool.plan_snapshot(a, 8)
    assert planned is not None
    b = req("b", range(200, 209))
    assert pool.allocate(b, 8)
    assert pool.plan_snapshot(b, 8) is None  # the only row is still being written
    pool.reset_prefix_cache()  # a's blocks are no longer cached when the copy lands
    pool.publish_snapshot(*planned)
    assert pool.snapshots == {} and list(pool.snapshot_rows) == [SLOTS]


def test_interval_must_be_a_multiple_of_the_block_size():
    with pytest.raises(ValueError, match="multiple of block_size"):
        manager(interval=6)


def test_scheduler_cuts_prompts_plans_copies_and_restores():
    pool = manager()
    scheduler = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=100)
    prompt = list(range(100, 119))  # 19 tokens
    a = req("a", prompt)
    scheduler.add(a)
    cuts, saves = [], []
    for _ in range(3):
        batch = scheduler.schedule()
        cuts.append(batch.num_tokens[0])
        saves += batch.state_saves
        sampled = [[9]] if batch.sample_indices else []
        scheduler.update_from_output(batch, ModelOutput(batch.requests[: len(sampled)], sampled))
    assert cuts == [8, 8, 3]
    assert [(slot, row) for slot, row, _ in saves] == [(a.state_slot, SLOTS), (a.state_slot, SLOTS + 1)]
    assert set(pool.snapshots.values()) == {SLOTS, SLOTS + 1}  # published once their steps ended
    b = req("b", prompt[:16] + [5, 5, 5])
    scheduler.add(b)
    batch = scheduler.schedule()
    i = batch.requests.index(b)
    assert batch.context_lens[i] == 16 and batch.num_tokens[i] == 3
    assert batch.state_restores == [(SLOTS + 1, b.state_slot)]
