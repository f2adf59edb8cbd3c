"""Prefix caching: hand-checked manager cases and engine outputs with cache hits."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.runtime.kv_cache_manager import KVCacheManager, block_hash
from engine.runtime.request import Request
from engine.sampling_params import SamplingParams as Params


def computed(manager: KVCacheManager, tokens: list[int], rid: str) -> Request:
    """A request whose whole prompt has been allocated (as after its prefill step)."""
    request = Request(rid, tokens, Params())
    hits = manager.find_cached_prefix(request)
    assert manager.allocate(request, len(tokens) - len(hits) * manager.block_size, hits)
    request.num_computed_tokens = len(tokens)
    return request


def test_hashes_chain_over_full_blocks_only():
    manager = KVCacheManager(8, 4, salt=b"s")
    request = Request("a", list(range(10)), Params())
    manager.update_hashes(request)
    first = block_hash(b"s", [0, 1, 2, 3])
    assert request.block_hashes == [first, block_hash(first, [4, 5, 6, 7])]


def test_shared_prefix_hits_and_leaves_one_token_to_compute():
    manager = KVCacheManager(16, 4)
    a = computed(manager, list(range(10)), "a")
    manager.free(a)
    b = Request("b", list(range(8)) + [99, 98], Params())
    hits = manager.find_cached_prefix(b)
    assert hits == a.block_ids[:0] + hits and len(hits) == 2  # blocks of tokens 0..7
    assert manager.allocate(b, 2, hits)
    assert b.num_computed_tokens == 8 and b.block_ids[:2] == hits
    # an identical 8-token prompt may reuse only its first block: the last token is recomputed
    c = Request("c", list(range(8)), Params())
    assert len(manager.find_cached_prefix(c)) == 1


def test_shared_blocks_are_reference_counted():
    manager = KVCacheManager(16, 4)
    a = computed(manager, list(range(12)), "a")
    b = computed(manager, list(range(12)) + [5], "b")
    assert b.block_ids[:3] == a.block_ids[:3]
    assert all(manager.ref_counts[blk] == 2 for blk in a.block_ids[:3])
    manager.free(a)
    assert all(manager.ref_counts[blk] == 1 for blk in b.block_ids[:3])
    manager.free(b)
    assert manager.num_free_blocks == 16


def published(manager: KVCacheManager, request: Request) -> list[bool]:
    """For each full block of the request: whether the prefix cache maps its hash to it."""
    full = request.num_tokens // manager.block_size
    return [manager.cached.get(request.block_hashes[i]) == request.block_ids[i] for i in range(full)]


def test_blocks_are_published_again_after_a_reset_and_once_a_duplicate_is_evicted():
    manager = KVCacheManager(16, 4)
    a = computed(manager, list(range(12)), "a")
    assert published(manager, a) == [True, True, True]
    # a running request's blocks lose their hashes with the reset, and get them back at its next step
    manager.reset_prefix_cache()
    assert not manager.cached
    a.append_token(12)
    assert manager.allocate(a, 1)
    assert published(manager, a) == [True, True, True]
    # a's prompt and one block more, computed without a hit: the blocks that repeat a's stay
    # unpublished while a's hold the hashes...
    b = Request("b", list(range(16)), Params())
    assert manager.allocate(b, 16)
    b.num_computed_tokens = 16
    assert published(manager, b) == [False, False, False, True]
    # ...and are published at b's next step once a's blocks were evicted
    manager.free(a)
    manager.return_free_blocks(manager.take_free_blocks(manager.num_free_blocks))
    b.append_token(16)
    assert manager.allocate(b, 1)
    assert published(manager, b) == [True, True, True, True]


def test_lru_eviction_drops_the_oldest_cached_blocks_first():
    manager = KVCacheManager(4, 4)
    old = computed(manager, [1] * 4 + [0], "old")  # caches one block, holds two
    manager.free(old)
    new = computed(manager, [2] * 4 + [0], "new")
    manager.free(new)
    # two cached blocks remain; taking three blocks evicts the uncached ones and then the older cached one
    taker = Request("t", [3] * 12, Params())
    assert manager.allocate(taker, 12)
    assert manager.find_cached_prefix(Request("x", [1] * 4 + [0], Params())) == []
    assert len(manager.find_cached_prefix(Request("y", [2] * 4 + [0], Params()))) == 1


def test_different_salt_never_hits():
    first = KVCacheManager(8, 4, salt=b"model-a")
    a = computed(first, list(range(9)), "a")
    request = Request("b", list(range(9)), Params())
    first.update_hashes(request)
    other = Request("c", list(range(9)), Params())
    KVCacheManager(8, 4, salt=b"model-b").update_hashes(other)
    assert request.block_hashes == a.block_hashes and other.block_hashes != a.block_hashes


def test_allocation_failure_changes_nothing():
    manager = KVCacheManager(3, 4)
    a = computed(manager, list(range(5)), "a")
    manager.free(a)
    b = Request("b", list(range(4)) + list(range(100, 120)), Params())
    hits = manager.find_cached_prefix(b)
    before = (list(manager.ref_counts), list(manager.free_queue), dict(manager.cached))
    assert not manager.allocate(b, 20, hits)
    assert (list(manager.ref_counts), list(manager.free_queue), dict(manager.cached)) == before
    assert b.block_ids == [] and b.num_computed_tokens == 0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from engine.testing.checkpoints import make_tiny_checkpoint

    path = tmp_path_factory.mktemp("llama")
    return path, make_tiny_checkpoint("LlamaForCausalLM", path)


def test_greedy_outputs_unchanged_by_prefix_cache_hits(checkpoint):
    path, _ = checkpoint
    rng = random.Random(0)
    prefix = [rng.randrange(3, 320) for _ in range(37)]
    prompts = [prefix + [rng.randrange(3, 320) for _ in range(rng.randint(1, 9))] for _ in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

    def make(enable: bool) -> LLM:
        return LLM(
            str(path),
            plugins=["cpu", "llama"],
            dtype="float32",
            progress=False,
            kv_cache_memory=0.05,
            block_size=4,
            enable_prefix_caching=enable,
        )

    reference = [o.outputs[0].token_ids for o in make(False).generate(prompts, params, use_tqdm=False)]
    llm = make(True)
    first = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    stats = llm.engine.kv_manager.stats
    assert first == reference and again == reference
    # every prompt after the first found at least the 9 full blocks of the shared prefix
    assert stats.hits >= 5 * 36 + 6 * 36
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.kv_cache.num_blocks


def test_reset_prefix_cache_makes_the_next_prompt_miss(checkpoint):
    path, _ = checkpoint
    llm = LLM(str(path), plugins=["cpu", "llama"], dtype="float32", progress=False, kv_cache_memory=0.05, block_size=4)
    prompt = list(range(3, 40))  # 9 full blocks
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    stats = llm.engine.kv_manager.stats
    reference = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert stats.hits == 0
    assert llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == reference
    assert stats.hits == 36
    llm.engine.reset_prefix_cache()
    assert llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == reference
    assert stats.hits == 36  # computed afresh
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.kv_cache.num_blocks
