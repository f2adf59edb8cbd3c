"""Checks of multi-head, grouped-query and sliding-window attention (kinds ``mha`` and
``sliding_window``, :class:`engine.interfaces.attention.PagedAttentionBackend`), against
:func:`engine.testing.oracles.naive_attention` over the unpaged keys and values."""

from __future__ import annotations

import zlib

import pytest
import torch

from engine.interfaces.attention import MHA, SLIDING_WINDOW, AttentionSpec
from engine.testing.kit.attention.base import BATCHES, KIT_BLOCK_SIZES, make_common_metadata, random_batch
from engine.testing.kit.attention.steps import PagedCacheSteps, PagedCase
from engine.testing.kit.base import capability_skip

HEAD_LAYOUTS = {"mha": (4, 4), "gqa2": (4, 2), "gqa4": (8, 2), "mqa": (4, 1)}  # (num_heads, num_kv_heads)
# sliding windows, as a function of the block size: a single key, just across a block edge, across
# two edges, and wider than every sequence (the same as full causal attention)
WINDOWS = {
    "w1": lambda bs: 1,
    "block+1": lambda bs: bs + 1,
    "2blocks+3": lambda bs: 2 * bs + 3,
    "wide": lambda bs: 1000,
}


class PagedChecks(PagedCacheSteps):
    """``test_mha``, ``test_sliding_window``, ``test_attention_sinks`` and ``test_batch_invariant_mode``."""

    @pytest.mark.parametrize("batch", BATCHES)
    @pytest.mark.parametrize("block_size", KIT_BLOCK_SIZES)
    @pytest.mark.parametrize("heads", list(HEAD_LAYOUTS))
    def test_mha(self, batch: str, block_size: int, heads: str, dtype: str, engine_device: str) -> None:
        """Full causal attention (MHA, GQA 2 and 4, MQA) over shuffled paged blocks matches the
        oracle for decode-only, prefill-after-prefix and mixed ragged batches."""
        self.check_random_case(MHA, batch, block_size, heads, None, dtype, engine_device)

    @pytest.mark.parametrize("window", list(WINDOWS))
    @pytest.mark.parametrize("block_size", KIT_BLOCK_SIZES)
    def test_sliding_window(self, window: str, block_size: int, dtype: str, engine_device: str) -> None:
        """Only the last ``sliding_window`` keys are attended to: windows of one key, just
        across one and two block edges, and wider than the sequence."""
        index = list(WINDOWS).index(window) + KIT_BLOCK_SIZES.index(block_size)
        batch, heads = BATCHES[index % len(BATCHES)], list(HEAD_LAYOUTS)[index % len(HEAD_LAYOUTS)]
        self.check_random_case(SLIDING_WINDOW, batch, block_size, heads, window, dtype, engine_device)

    @pytest.mark.parametrize("window", [None, "block+1"])
    @pytest.mark.parametrize("block_size", KIT_BLOCK_SIZES)
    def test_attention_sinks(self, window: str | None, block_size: int, dtype: str, engine_device: str) -> None:
        """A backend declaring ``capabilities.sinks``, for a spec with ``sinks``: each query head's
        softmax also runs over its sink logit (given to ``forward`` as ``sinks``), which takes its
        share of the weight and adds no value; with full causal attention and a sliding window
        across a block edge, grouped-query heads each with their own sink."""
        kind = SLIDING_WINDOW if window else MHA
        cls, _ = self.setup_backend(kind, dtype, engine_device, block_size)
        if not cls.capabilities.sinks:
            capability_skip("attention sinks")
        index = KIT_BLOCK_SIZES.index(block_size) + (window is not None)
        batch, heads = BATCHES[index % len(BATCHES)], ("gqa4", "gqa2", "mha")[index % 3]
        self.check_random_case(kind, batch, block_size, heads, window, dtype, engine_device, sinks=True)

    def check_random_case(
        self,
        kind: str,
        batch: str,
        block_size: int,
        heads: str,
        window: str | None,
        dtype: str,
        engine_device: str,
        sinks: bool = False,
    ) -> None:
        """Two steps over a random ragged batch in a stale cache: a prefill of the cached
        prefixes, then the new tokens after them; both steps must match the oracle (with
        ``sinks``: random sink logits, one per query head)."""
        label = f"{kind}/{batch}/{block_size}/{heads}/{window}" + ("/sinks" if sinks else "")
        gen = torch.Generator().manual_seed(zlib.crc32(label.encode()))
        # every head layout meets every head size across the block sizes
        head_size = self.head_size(list(HEAD_LAYOUTS).index(heads) + KIT_BLOCK_SIZES.index(block_size))
        cls, device = self.setup_backend(kind, dtype, engine_device, block_size)
        # a scale other than the usual head_size ** -0.5, so that a backend ignoring spec.scale fails
        scale = head_size**-0.5 * (0.5 + float(torch.rand((), generator=gen)))
        sliding_window = WINDOWS[window](block_size) if window else None
        spec = AttentionSpec(kind, *HEAD_LAYOUTS[heads], head_size, scale, sliding_window, sinks=sinks)
        context_lens, query_lens = random_batch(batch, gen)
        seq_lens = [c + n for c, n in zip(context_lens, query_lens)]
        case = self.new_case(cls, spec, block_size, dtype, device, seq_lens, gen, stale_cache=True)
        self.run_prefix_then_new_tokens(case, context_lens, query_lens)

    @pytest.mark.parametrize("block_size", KIT_BLOCK_SIZES)
    def test_batch_invariant_mode(self, block_size: int, dtype: str, engine_device: str) -> None:
        """A backend declaring ``capabilities.batch_invariant``, with its ``batch_invariant``
        attribute set (``--batch-invariant``): every token's output is bitwise the same as one
        prefill of its whole sequence, as chunks beside other sequences' prefills and decodes,
        and decoded one token at a time, in every dtype it declares."""
        cls, device = self.setup_backend(MHA, dtype, engine_device, block_size)
        if not cls.capabilities.batch_invariant:
            capability_skip("batch_invariant")
        gen = torch.Generator().manual_seed(zlib.crc32(f"invariant/{block_size}/{dtype}".encode()))
        spec = AttentionSpec(MHA, 4, 2, self.head_size(block_size), 0.2, None)
        seq_lens = [40, 29, 17]
        case = self.new_case(cls, spec, block_size, dtype, device, seq_lens, gen, stale_cache=False)
        case.backend.batch_invariant = True

        whole = self._rows(case, [(0, 0, 40)])[0]
        chunked = [
            self._rows(case, [(1, 0, 29), (0, 0, 7)])[1],  # beside another prefill
            self._rows(case, [(0, 7, 16), (2, 0, 17), (1, 28, 1)])[0],  # beside a prefill and a decode
            self._rows(case, [(2, 16, 1), (0, 23, 17)])[1],
        ]
        decoded = [self._rows(case, [(0, p, 1)])[0] for p in range(40)]
        for name, rows in (("in chunks beside other sequences", chunked), ("decoded token by token", decoded)):
            got = torch.cat(rows)
            differ = (got != whole).flatten(1).any(1).nonzero().flatten().tolist()
            assert not differ, (
                f"{cls.name} in batch-invariant mode, {dtype}, block size {block_size}: positions {differ} of a "
                f"40-token sequence {name} differ from its one-step prefill"
            )

    def _rows(self, case: PagedCase, seqs: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """One step of ``seqs`` = [(sequence, cached tokens, new tokens)]: each one's output rows."""
        bs = case.block_size
        starts, lens = [c for _, c, _ in seqs], [n for _, _, n in seqs]
        tables = [case.tables[b][: -(-(c + n) // bs)] for b, c, n in seqs]
        common = make_common_metadata(starts, lens, tables, bs, case.cache.device)
        q, k, v = (torch.cat([full[b][c : c + n] for b, c, n in seqs]) for full in (case.q, case.k, case.v))
        with torch.inference_mode():
            out = case.backend.forward(q, k, v, case.cache, case.backend.build_metadata(common))
        return list(out.split(lens))
