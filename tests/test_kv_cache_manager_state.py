"""A hypothesis state machine over the KV cache manager: after every operation no
block is leaked or double-owned and reference counts match the owners."""

from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.runtime.kv_cache_manager import KVCacheManager
from engine.runtime.request import Request
from engine.sampling_params import SamplingParams

BLOCK_SIZE = 4
NUM_BLOCKS = 12
TOKENS = st.lists(st.integers(0, 3), min_size=1, max_size=24)  # a tiny alphabet makes shared prefixes common


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.manager = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE)
        self.manager.record_evictions = True
        self.tier: set[bytes] = set()  # hashes a secondary tier holds: every block the cache evicted
        self.running: dict[str, Request] = {}
        self.waiting: dict[str, Request] = {}
        self.ids = 0

    def _new_id(self) -> str:
        self.ids += 1
        return f"r{self.ids}"

    def _admit(self, request: Request) -> None:
        """Schedule a whole (re)prefill, as the scheduler does with an ample token budget."""
        hits = self.manager.find_cached_prefix(request)
        num_new = request.num_tokens - len(hits) * BLOCK_SIZE
        if self.manager.allocate(request, num_new, hits):
            request.num_computed_tokens = request.num_tokens
            self.running[request.request_id] = request
            self.waiting.pop(request.request_id, None)
        else:
            assert request.block_ids == [] and request.num_computed_tokens == 0
            self.waiting[request.request_id] = request

    @rule(tokens=TOKENS)
    def add(self, tokens):
        self._admit(Request(self._new_id(), tokens, SamplingParams()))

    @precondition(lambda self: self.running)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 3), max_size=6))
    def fork_prefix(self, data, extra):
        """A new request sharing a running request's prefix (like n > 1 or a chat turn)."""
        parent = data.draw(st.sampled_from(sorted(self.running)))
        cut = data.draw(st.integers(1, self.running[parent].num_tokens))
        self._admit(Request(self._new_id(), self.running[parent].token_ids[:cut] + extra, SamplingParams()))

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=st.integers(0, 3))
    def append(self, data, token):
        """A decode step: room for the last sampled token, then a new token."""
        request = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        request.append_token(token)
        if self.manager.allocate(request, 1):
            request.num_computed_tokens += 1
        else:
            self._preempt(request)

    def _preempt(self, request: Request) -> None:
        self.manager.free(request)
        request.num_computed_tokens = 0
        del self.running[request.request_id]
        self.waiting[request.request_id] = request

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data):
        self._preempt(self.running[data.draw(st.sampled_from(sorted(self.running)))])

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def resume(self, data):
        self._admit(self.waiting[data.draw(st.sampled_from(sorted(self.waiting)))])

    @precondition(lambda self: self.running or self.waiting)
    @rule(data=st.data())
    def finish_or_abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.running) + sorted(self.waiting)))
        request = self.running.pop(rid, None) or self.waiting.pop(rid)
        self.manager.free(request)

    @rule(tokens=TOKENS, loads=st.integers(0, 4))
    def tier_prefetch_then_add(self, tokens, loads):
        """A request whose blocks after its primary hit come back from the tier, as
        KVTierConnector.prefetch does; the tier returns only the first ``loads`` of them."""
        manager = self.manager
        self.tier.update(h for _, h in manager.take_evicted())
        request = Request(self._new_id(), tokens, SamplingParams())
        manager.update_hashes(request)
        hashes = request.block_hashes[: (request.num_tokens - 1) // BLOCK_SIZE]
        hit = 0
        while hit < len(hashes) and hashes[hit] in manager.cached:
            hit += 1
        keys = []
        for h in hashes[hit:]:
            if h not in self.tier:
                break
            keys.append(h)
        n = min(len(keys), manager.num_free_blocks - manager.protect(hashes[:hit]))
        if n > 0:
            blocks = manager.take_free_blocks(n)
            self.tier.update(h for _, h in manager.take_evicted())
            loaded = min(n, loads)
            manager.publish_loaded(blocks[:loaded], keys[:loaded])
            manager.return_free_blocks(blocks[loaded:])
            # the primary hit survived, and the loaded run joined it
            assert all(h in manager.cached for h in hashes[: hit + loaded])
        self._admit(request)

    @invariant()
    def reference_counts_match_owners(self):
        owners = Counter(b for r in self.running.values() for b in r.block_ids)
        for block in range(NUM_BLOCKS):
            assert self.manager.ref_counts[block] == owners.get(block, 0)
        assert all(not r.block_ids for r in self.waiting.values())

    @invariant()
    def free_queue_is_exactly_the_unowned_blocks(self):
        free = list(self.manager.free_queue)
        assert len(free) == len(set(free))
        assert set(free) == {b for b in range(NUM_BLOCKS) if self.manager.ref_counts[b] == 0}

    @invariant()
    def no_block_is_shared_unless_it_holds_the_same_cached_prefix(self):
        holders: dict[int, set[bytes]] = {}
        for request in self.running.values():
            self.manager.update_hashes(request, request.num_computed_tokens)
            for i, block in enumerate(request.block_ids):
                full = (i + 1) * BLOCK_SIZE <= request.num_computed_tokens
                holders.setdefault(block, set()).add(request.block_hashes[i] if full else request.request_id.encode())
                # a block published in the cache holds exactly the tokens its hash names
                published = self.manager.block_hashes[block]
                assert published is None or (full and published == request.block_hashes[i])
        assert all(len(contents) == 1 for contents in holders.values())

    @invariant()
    def cache_index_is_consistent(self):
        for h, block in self.manager.cached.items():
            assert self.manager.block_hashes[block] == h
        assert len(set(self.manager.cached.values())) == len(self.manager.cached)

    @invariant()
    def tables_cover_computed_tokens(self):
        for request in self.running.values():
            assert len(request.block_ids) == -(-request.num_computed_tokens // BLOCK_SIZE)

    def teardown(self):
        for request in list(self.running.values()) + list(self.waiting.values()):
            self.manager.free(request)
        # after every request ends, all blocks are free (cached or not)
        assert self.manager.num_free_blocks == NUM_BLOCKS
        assert all(count == 0 for count in self.manager.ref_counts)


TestKVCacheManager = KVCacheMachine.TestCase
TestKVCacheManager.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_state_slots_are_taken_at_first_allocation_and_returned_on_free():
    """Hybrid models: each request holds one recurrent-state slot from its first allocation until
    it is freed (finished, aborted or preempted), and a freed slot serves the next request."""
    from engine.runtime.kv_cache_manager import KVCacheManager
    from engine.runtime.request import Request
    from engine.sampling_params import SamplingParams

    manager = KVCacheManager(8, 4, enable_prefix_caching=False, num_state_slots=2)
    a, b, c = (Request(name, [1, 2, 3, 4, 5], SamplingParams()) for name in "abc")
    assert manager.allocate(a, 5) and manager.allocate(b, 3)
    assert (a.state_slot, b.state_slot) == (0, 1)
    assert manager.allocate(a, 0) and a.state_slot == 0  # later steps keep the slot
    assert not manager.allocate(c, 2) and c.state_slot is None and not c.block_ids  # none left: nothing taken
    manager.free(a)  # finished or preempted
    assert a.state_slot is None and manager.allocate(c, 2) and c.state_slot == 0
    manager.free(b)
    manager.free(c)
    assert sorted(manager.free_state_slots) == [0, 1] and manager.num_free_blocks == 8
