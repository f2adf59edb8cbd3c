"""Checks of DeepSeek sparse attention's indexer (kind ``indexer``,
:class:`engine.interfaces.attention.IndexerBackend`): its selections against
:func:`engine.testing.oracles.naive_index_scores`, the right number of distinct causal
positions, none scoring below one left out."""

from __future__ import annotations

import zlib

import pytest
import torch

from engine.interfaces.attention import INDEXER, AttentionSpec, CommonAttentionMetadata
from engine.testing.kit.attention.base import BATCHES, KIT_BLOCK_SIZES, random_batch
from engine.testing.kit.attention.steps import PagedCacheSteps, PagedCase
from engine.testing.oracles import naive_index_scores

# indexers: query heads, and index_topk (one position, a few, more than any sequence has)
INDEXER_NUM_HEADS = (1, 4, 16)
INDEXER_TOPKS = (1, 7, 1000)


class IndexerChecks(PagedCacheSteps):
    """``test_indexer``."""

    @pytest.mark.parametrize("batch", BATCHES)
    @pytest.mark.parametrize("block_size", KIT_BLOCK_SIZES)
    def test_indexer(self, batch: str, block_size: int, dtype: str, engine_device: str) -> None:
        """The sparse-attention indexer (``forward_index``) over paged keys: for decode, prefill
        and mixed batches, 1/4/16 query heads and index_topk 1, 7 and more than any sequence,
        each query gets min(index_topk, its positions) distinct causal positions, and none left
        out scores above one selected (``None`` is allowed only when every sequence fits)."""
        self.check_index_case(batch, block_size, dtype, engine_device)

    def check_index_case(self, batch: str, block_size: int, dtype: str, engine_device: str) -> None:
        """An indexer over three steps of a random ragged batch in a stale cache (prefixes, new
        tokens, a decode each with the rows reversed): every step's selections are checked."""
        gen = torch.Generator().manual_seed(zlib.crc32(f"{INDEXER}/{batch}/{block_size}".encode()))
        cls, device = self.setup_backend(INDEXER, dtype, engine_device, block_size)
        index = BATCHES.index(batch) + KIT_BLOCK_SIZES.index(block_size)
        head_size = self.head_size(index)
        scale = head_size**-0.5 * (0.5 + float(torch.rand((), generator=gen)))
        spec = AttentionSpec(
            INDEXER,
            INDEXER_NUM_HEADS[index % len(INDEXER_NUM_HEADS)],
            1,
            head_size,
            scale,
            index_topk=INDEXER_TOPKS[index % len(INDEXER_TOPKS)],
        )
        context_lens, query_lens = random_batch(batch, gen)
        seq_lens = [c + n for c, n in zip(context_lens, query_lens)]
        case = self.new_case(cls, spec, block_size, dtype, device, [n + 1 for n in seq_lens], gen, stale_cache=True)
        self.run_prefix_then_new_tokens(case, context_lens, query_lens)
        order = list(reversed(range(len(seq_lens))))
        self.run_step(
            case,
            "step 3 (one decode each after the new tokens, batch rows reversed)",
            order,
            [seq_lens[b] for b in order],
            [1] * len(order),
        )

    def check_selections(
        self,
        case: PagedCase,
        label: str,
        seqs: list[int],
        starts: list[int],
        ends: list[int],
        common: CommonAttentionMetadata,
        out: torch.Tensor | None,
    ) -> None:
        """An indexer's result: ``None`` only when no sequence is longer than ``index_topk``;
        else [T, index_topk] int64 where the query at position ``p`` has min(index_topk, p + 1)
        distinct positions ``0..p`` and ``-1`` padding, and no position it left out scores
        above one it chose (within the dtype's tolerance) by the oracle's scores."""
        spec, (atol, rtol) = case.spec, self.tolerances[case.dtype]
        topk = spec.index_topk
        if out is None:
            assert max(ends) <= topk, (
                f"{label}: the indexer returned None (every position) though a sequence has {max(ends)} "
                f"positions, more than index_topk={topk}"
            )
            return
        expected_shape = (common.num_tokens, topk)
        assert tuple(out.shape) == expected_shape and out.dtype == torch.int64, (
            f"{label}: indexer output {out.dtype} {tuple(out.shape)}, expected torch.int64 {expected_shape}"
        )
        out = out.cpu()
        rows = common.query_start_loc.tolist()
        for b, s, e, r0 in zip(seqs, starts, ends, rows):
            scores = naive_index_scores(case.q[b][s:e], case.k[b], case.weights[b][s:e], s, spec.scale).cpu()
            for i, p in enumerate(range(s, e)):
                row = out[r0 + i]
                chosen = row[row >= 0]
                count = min(topk, p + 1)
                where = f"{label}: sequence {b}, query at position {p}, selected {sorted(chosen.tolist())}"
                assert bool((row[row < 0] == -1).all()), f"{where}: padding must be -1, got {row.tolist()}"
                assert chosen.numel() == count and chosen.unique().numel() == count, (
                    f"{where}: expected {count} distinct positions"
                )
                assert int(chosen.max()) <= p, f"{where}: a position after the query's own"
                if count <= p:
                    left_out = torch.ones(p + 1, dtype=torch.bool)
                    left_out[chosen] = False
                    lowest_in, highest_out = float(scores[i, chosen].min()), float(scores[i, : p + 1][left_out].max())
                    assert lowest_in >= highest_out - (atol + rtol * abs(highest_out)), (
                        f"{where}: position {int(torch.nonzero(left_out).flatten()[scores[i, : p + 1][left_out].argmax()])} "
                        f"scores {highest_out:.6f}, above the lowest selected score {lowest_in:.6f}"
                    )
