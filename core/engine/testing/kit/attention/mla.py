"""Checks of multi-head latent attention (kind ``mla``) and of sparse MLA (kind ``sparse_mla``;
:class:`engine.interfaces.attention.MLAAttentionBackend` and ``SparseMLAAttentionBackend``),
against :func:`engine.testing.oracles.naive_mla_attention` over the unpaged entries (sparse
MLA: over the positions the kit selected for each query)."""

from __future__ import annotations

import zlib

import pytest
import torch

from engine.interfaces.attention import MLA, SPARSE_MLA, AttentionSpec
from engine.testing.kit.attention.base import BATCHES, KIT_BLOCK_SIZES, MLA_SIZES, random_batch
from engine.testing.kit.attention.steps import PagedCacheSteps

# the numbers of query heads
MLA_NUM_HEADS = (1, 4, 16)
# sparse MLA: how many positions the kit selects for each query (fewer where it has fewer)
SPARSE_WIDTHS = (1, 3, 8)


def random_selections(seq_lens: list[int], width: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Per sequence [L, width]: for the query at position p, min(width, p + 1) distinct random
    positions 0..p and -1 padding, in random order; about one row in seven selects nothing."""
    selections = []
    for seq_len in seq_lens:
        rows = []
        for p in range(seq_len):
            empty = int(torch.randint(0, 7, (1,), generator=gen)) == 0
            chosen = torch.randperm(p + 1, generator=gen)[: 0 if empty else width]
            row = torch.cat([chosen, torch.full((width - chosen.numel(),), -1, dtype=torch.int64)])
            rows.append(row[torch.randperm(width, generator=gen)])
        selections.append(torch.stack(rows))
    return selections


class MLAChecks(PagedCacheSteps):
    """``test_mla`` and ``test_sparse_mla``."""

    @pytest.mark.parametrize("sizes", list(MLA_SIZES))
    @pytest.mark.parametrize("batch", BATCHES)
    @pytest.mark.parametrize("block_size", KIT_BLOCK_SIZES)
    def test_mla(self, batch: str, block_size: int, sizes: str, dtype: str, engine_device: str) -> None:
        """Multi-head latent attention (absorbed queries, one cached entry per token whose first
        ``latent_size`` dims are the value) over shuffled paged blocks matches the oracle for
        decode-only, prefill-after-prefix and mixed ragged batches, 1/4/16 query heads, and for
        a later decode step reading the new entries back."""
        self.check_mla_case(batch, block_size, sizes, dtype, engine_device)

    @pytest.mark.parametrize("sizes", list(MLA_SIZES))
    @pytest.mark.parametrize("batch", BATCHES)
    @pytest.mark.parametrize("block_size", KIT_BLOCK_SIZES)
    def test_sparse_mla(self, batch: str, block_size: int, sizes: str, dtype: str, engine_device: str) -> None:
        """Sparse MLA (``forward_sparse``): each query attends only to the positions the kit selects
        (1, 3 or 8 of them, in random order, ``-1`` padded; some rows none, giving zeros) and
        matches the oracle over those, and so does the log-sum-exp it writes to ``lse``;
        ``indices=None`` (the prefix prefill) is dense MLA. The same batches, block sizes, head
        counts and entry sizes as the MLA check."""
        self.check_mla_case(batch, block_size, sizes, dtype, engine_device, kind=SPARSE_MLA)

    def check_mla_case(
        self, batch: str, block_size: int, sizes: str, dtype: str, engine_device: str, kind: str = MLA
    ) -> None:
        """Three steps over a random ragged batch in a stale cache: a prefill of the cached
        prefixes, the new tokens after them, then one decode each with the batch rows reversed
        (which reads step 2's entries through the block tables only); all must match the oracle.
        Sparse MLA: the prefill without indices (dense), the later steps over random selections."""
        seed = f"{MLA}/{batch}/{block_size}/{sizes}" + ("" if kind == MLA else f"/{kind}")
        gen = torch.Generator().manual_seed(zlib.crc32(seed.encode()))
        cls, device = self.setup_backend(kind, dtype, engine_device, block_size)
        size_index = list(MLA_SIZES).index(sizes)
        latent_size, rope_size = self.mla_sizes(size_index)
        # every number of heads meets every entry size across the batches and block sizes
        index = BATCHES.index(batch) + KIT_BLOCK_SIZES.index(block_size) + size_index
        head_size = latent_size + rope_size
        scale = head_size**-0.5 * (0.5 + float(torch.rand((), generator=gen)))  # not the usual scale
        spec = AttentionSpec(
            kind, MLA_NUM_HEADS[index % len(MLA_NUM_HEADS)], 1, head_size, scale, latent_size=latent_size
        )
        context_lens, query_lens = random_batch(batch, gen)
        seq_lens = [c + n for c, n in zip(context_lens, query_lens)]
        case = self.new_case(cls, spec, block_size, dtype, device, [n + 1 for n in seq_lens], gen, stale_cache=True)
        if kind == SPARSE_MLA:
            case.select = random_selections([n + 1 for n in seq_lens], SPARSE_WIDTHS[index % len(SPARSE_WIDTHS)], gen)
        self.run_prefix_then_new_tokens(case, context_lens, query_lens)
        order = list(reversed(range(len(seq_lens))))
        self.run_step(
            case,
            "step 3 (one decode each after the new tokens, batch rows reversed)",
            order,
            [seq_lens[b] for b in order],
            [1] * len(order),
        )
