"""The core's token-state cache (kind token_state): values stored for a step's new tokens come
back by position through the block tables, across steps, for any sequence sharing the blocks."""

from __future__ import annotations

import torch

from engine.interfaces.attention import TOKEN_STATE, AttentionSpec
from engine.interfaces.forward_context import ForwardContext
from engine.runtime.token_state import TokenStateCache
from engine.testing.kit.attention import make_common_metadata, shuffled_block_tables

SPEC = AttentionSpec(TOKEN_STATE, 1, 1, 6, 1.0)


def step(backend, cache, tables, context_lens, query_lens, values, positions, block_size):
    """One step: store each sequence's new rows of ``values``, then gather ``positions``."""
    tables_now = [t[: -(-(c + n) // block_size)] for t, c, n in zip(tables, context_lens, query_lens)]
    common = make_common_metadata(context_lens, query_lens, tables_now, block_size, torch.device("cpu"))
    new = torch.cat([v[c : c + n] for v, c, n in zip(values, context_lens, query_lens)])
    ctx = ForwardContext(backends=[backend], kv_caches=[cache], metadata=[backend.build_metadata(common)])
    ctx.store(0, new)
    return ctx.gather(0, positions)


def test_values_come_back_by_position_across_steps_and_blocks():
    gen = torch.Generator().manual_seed(0)
    block_size, lens = 4, [7, 13, 1]
    tables, num_blocks = shuffled_block_tables([n + 2 for n in lens], block_size, gen)
    backend = TokenStateCache(SPEC, block_size, torch.float32, torch.device("cpu"))
    cache = torch.randn(backend.kv_cache_shape(num_blocks), generator=gen)  # stale contents
    values = [torch.randn(n + 2, 6, generator=gen) for n in lens]
    # step 1: prefill; every token reads positions 0, its own, and a padding -1
    positions = torch.cat([torch.tensor([[0, p, -1] for p in range(n)]) for n in lens])
    got = step(backend, cache, tables, [0, 0, 0], lens, values, positions, block_size)
    rows = [torch.stack([v[0], v[p], torch.zeros(6)]) for v, n in zip(values, lens) for p in range(n)]
    assert torch.equal(got, torch.stack(rows))
    # step 2: two new tokens each, the batch reversed; each reads all of its sequence's positions
    order = [2, 1, 0]
    width = max(lens) + 2
    positions = torch.cat([torch.tensor([[j if j < lens[b] + 2 else -1 for j in range(width)]] * 2) for b in order])
    got = step(
        backend,
        cache,
        [tables[b] for b in order],
        [lens[b] for b in order],
        [2, 2, 2],
        [values[b] for b in order],
        positions,
        block_size,
    )
    for i, b in enumerate(order):
        n = lens[b] + 2
        expected = torch.cat([values[b], torch.zeros(width - n, 6)])
        assert torch.equal(got[2 * i], expected) and torch.equal(got[2 * i + 1], expected)


def test_the_engine_serves_token_state_on_any_platform():
    assert TokenStateCache.validate(SPEC, platform="anything", dtype="float16", block_size=7) == []
    assert TokenStateCache.validate(AttentionSpec("mha", 4, 4, 8, 1.0), platform="cpu", dtype="float32", block_size=16)
