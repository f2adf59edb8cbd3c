"""Conformance checks for attention backends (hook ``register_attention_backends``).

The backend runs as the engine runs it: ``cls(spec, block_size, dtype, device)``,
a cache tensor of its own ``kv_cache_shape`` and, per step, the
:class:`CommonAttentionMetadata` the model runner builds, over shuffled block
tables. The cache layout stays private: cached prefixes get into the cache
through the backend's own ``forward`` (a prefill step of the prefixes) before
the step under test. Every step's output is compared with
:func:`engine.testing.oracles.naive_attention` over the unpaged K/V, or for MLA
(absorbed queries, one latent entry cached per token, no values) with
:func:`engine.testing.oracles.naive_mla_attention` over the unpaged entries (sparse
MLA: over the positions the kit selected for each query). An indexer's selections
are checked against :func:`engine.testing.oracles.naive_index_scores`: the right
number of distinct causal positions, none scoring below one left out.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from engine.interfaces.attention import (
    ATTENTION_KINDS,
    INDEXER,
    LINEAR,
    MHA,
    MLA,
    SLIDING_WINDOW,
    SPARSE_MLA,
    AttentionBackend,
    AttentionCapabilities,
    AttentionSpec,
    CommonAttentionMetadata,
)
from engine.testing.kit.base import KitTests, capability_skip
from engine.testing.oracles import naive_attention, naive_index_scores, naive_kda, naive_mla_attention

KIT_BLOCK_SIZES = (1, 4, 16)
KIT_HEAD_SIZES = (16, 32, 64)
HEAD_LAYOUTS = {"mha": (4, 4), "gqa2": (4, 2), "gqa4": (8, 2), "mqa": (4, 1)}  # (num_heads, num_kv_heads)
# MLA entries: (latent_size, rope dims), head_size their sum; and the numbers of query heads
MLA_SIZES = {"32+8": (32, 8), "64+16": (64, 16)}
MLA_NUM_HEADS = (1, 4, 16)
# sparse MLA: how many positions the kit selects for each query (fewer where it has fewer)
SPARSE_WIDTHS = (1, 3, 8)
# indexers: query heads, and index_topk (one position, a few, more than any sequence has)
INDEXER_NUM_HEADS = (1, 4, 16)
INDEXER_TOPKS = (1, 7, 1000)
# linear attention: (heads, head_size, value_size, convolution kernel)
LINEAR_SHAPES = {"h1": (1, 8, 8, 2), "h2": (2, 16, 8, 4), "h4": (4, 8, 16, 3)}
# "long": two sequences fed in chunks of these sizes, step by step (crossing 64-token chunks)
LONG_CHUNKS = ([64, 1, 5, 70], [5, 64, 1, 9])
BATCHES = ("decode", "prefill", "mixed")
# sliding windows, as a function of the block size: a single key, just across a block edge, across
# two edges, and wider than every sequence (the same as full causal attention)
WINDOWS = {"w1": lambda bs: 1, "block+1": lambda bs: bs + 1, "2blocks+3": lambda bs: 2 * bs + 3,
           "wide": lambda bs: 1000}


def make_common_metadata(
    context_lens: list[int], query_lens: list[int], block_tables: list[list[int]], block_size: int,
    device: torch.device, state_slots: list[int] | None = None,
) -> CommonAttentionMetadata:
    """One step's metadata, computed as the engine's model runner does (runtime/model_runner.py).

    Sequence ``b`` has ``context_lens[b]`` cached tokens and ``query_lens[b]`` new ones, and
    owns the physical blocks ``block_tables[b]`` (rows padded with block 0) and, for linear
    attention, the state slot ``state_slots[b]``.
    """
    width = max(len(table) for table in block_tables)
    tables = torch.tensor([table + [0] * (width - len(table)) for table in block_tables], dtype=torch.int64)
    context = torch.tensor(context_lens, dtype=torch.int64)  # [B]
    query = torch.tensor(query_lens, dtype=torch.int64)  # [B]
    seq_lens = context + query
    query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int64)  # [B + 1]
    query_start_loc[1:] = query.cumsum(0)
    seq_idx = torch.repeat_interleave(torch.arange(len(query_lens)), query)  # [T]
    positions = torch.arange(int(query.sum())) - query_start_loc[seq_idx] + context[seq_idx]  # [T]
    slot_mapping = tables[seq_idx, positions // block_size] * block_size + positions % block_size  # [T]
    return CommonAttentionMetadata(
        query_start_loc=query_start_loc.to(device), query_lens=query.to(device), context_lens=context.to(device),
        seq_lens=seq_lens.to(device), block_tables=tables.to(device), slot_mapping=slot_mapping.to(device),
        max_query_len=int(query.max()), max_seq_len=int(seq_lens.max()), block_size=block_size,
        state_slots=None if state_slots is None else torch.tensor(state_slots, dtype=torch.int64, device=device),
    )


def random_batch(batch: str, gen: torch.Generator) -> tuple[list[int], list[int]]:
    """(context_lens, query_lens) of a random ragged batch of kind ``batch``."""

    def randint(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (1,), generator=gen))

    if batch == "decode":  # ragged cached contexts, one new token each
        n = randint(3, 6)
        return [randint(0, 40) for _ in range(n)], [1] * n
    if batch == "prefill":  # chunks of 2..24 tokens, most after a cached prefix
        n = randint(1, 3)
        return [randint(0, 24) for _ in range(n)], [randint(2, 24) for _ in range(n)]
    # mixed: decodes and chunks interleaved, at least one of each
    n = randint(3, 5)
    rows = [(randint(1, 40), 1), (randint(0, 20), randint(2, 20))]
    rows += [(randint(0, 30), 1 if randint(0, 1) else randint(2, 20)) for _ in range(n - 2)]
    order = torch.randperm(n, generator=gen).tolist()
    return [rows[i][0] for i in order], [rows[i][1] for i in order]


def shuffled_block_tables(seq_lens: list[int], block_size: int, gen: torch.Generator,
                          spare: int = 3) -> tuple[list[list[int]], int]:
    """Each sequence's blocks, drawn at random from a pool with ``spare`` unused blocks."""
    counts = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(counts) + spare
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, start = [], 0
    for count in counts:
        tables.append(perm[start : start + count])
        start += count
    return tables, num_blocks


@dataclass
class PagedCase:
    """A backend under test with its cache, and every sequence's q/k/v by position."""

    spec: AttentionSpec  # the kit's spec: the oracle's truth, whatever the backend keeps
    block_size: int
    dtype: str
    backend: AttentionBackend
    cache: torch.Tensor  # the backend's kv_cache_shape(num_blocks)
    tables: list[list[int]]  # each sequence's physical blocks, for all its positions
    num_blocks: int
    q: list[torch.Tensor]  # per sequence [L, H, D]
    k: list[torch.Tensor]  # per sequence [L, Hkv, D] (MLA: the cache entries, indexer: its keys; Hkv = 1)
    v: list[torch.Tensor]  # per sequence [L, Hkv, D] (MLA, indexer: empty, there are no values)
    # sparse MLA: per sequence [L, width] the positions each query attends to (-1 padding)
    select: list[torch.Tensor] | None = None
    weights: list[torch.Tensor] | None = None  # indexer: per sequence [L, H] head weights


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


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns of ``t``'s elements, as integers (for byte-exact comparisons)."""
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(ints[t.element_size()])


class AttentionBackendTests(KitTests):
    """Kit for an attention backend. Set ``plugin`` and ``backend_name``; ``dtypes`` lists the
    compute dtypes to check (each must be declared in ``capabilities.dtypes``, else the checks
    skip). ``tolerances`` maps a dtype to ``(atol, rtol)`` against the float32 oracle."""

    registry_name = "attention_backends"
    backend_name: ClassVar[str | None] = None
    dtypes: ClassVar[tuple[str, ...]] = ("float32",)
    tolerances: ClassVar[dict[str, tuple[float, float]]] = {
        "float32": (1e-5, 1e-5), "bfloat16": (2e-2, 2e-2), "float16": (2e-3, 2e-3),
    }

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        """Checks taking a ``dtype`` argument run once per entry of this class's ``dtypes``."""
        if "dtype" in metafunc.fixturenames:
            metafunc.parametrize("dtype", list(metafunc.cls.dtypes))

    # -- helpers --------------------------------------------------------------------------

    def backend_class(self) -> type[AttentionBackend]:
        """The registered backend class, resolved once per kit class (cached on the class)."""
        cls = type(self)
        if "_kit_backend_class" not in cls.__dict__:
            cls._kit_backend_class = self.resolve(self.required("backend_name"))
        return cls._kit_backend_class

    def torch_device(self, engine_device: str) -> torch.device:
        """The torch device of the platform ``engine_device`` (from any installed plugin)."""
        if engine_device == "cpu":
            return torch.device("cpu")
        from engine.plugins.manager import get_plugin_manager

        platforms = self.components().platforms
        if engine_device not in platforms:
            platforms = get_plugin_manager([], autoload=True).components().platforms
        platform = platforms.get(engine_device)
        availability = platform.is_available()
        if not availability:
            pytest.skip(f"platform {engine_device} is not available: {availability.reason}")
        return platform().device()

    def setup_backend(
        self, kind: str, dtype: str, engine_device: str, block_size: int
    ) -> tuple[type[AttentionBackend], torch.device]:
        """Skip unless the backend declares kind, dtype, platform and block size."""
        cls = self.backend_class()
        caps = cls.capabilities
        if kind not in caps.kinds:
            capability_skip(f"attention kind {kind}")
        if dtype not in caps.dtypes:
            capability_skip(f"dtype {dtype}")
        if engine_device not in caps.platforms:
            capability_skip(f"platform {engine_device}")
        if caps.block_sizes is not None and block_size not in caps.block_sizes:
            capability_skip(f"block size {block_size}")
        return cls, self.torch_device(engine_device)

    def head_size(self, index: int) -> int:
        """The ``index``-th (cyclically) head size to check: 16/32/64 where declared."""
        declared = self.backend_class().capabilities.head_sizes
        sizes = [h for h in KIT_HEAD_SIZES if declared is None or h in declared] or sorted(declared)[:3]
        return sizes[index % len(sizes)]

    def mla_sizes(self, index: int) -> tuple[int, int]:
        """The ``index``-th (cyclically) MLA ``(latent_size, rope dims)`` to check: 32+8 and 64+16
        where their sum is a declared head size, else declared head sizes split 8:1 (576: 512+64)."""
        declared = self.backend_class().capabilities.head_sizes
        sizes = [s for s in MLA_SIZES.values() if declared is None or sum(s) in declared]
        sizes = sizes or [(h - h // 9, h // 9) for h in sorted(declared)[:2]]
        return sizes[index % len(sizes)]

    def new_case(self, cls: type[AttentionBackend], spec: AttentionSpec, block_size: int, dtype: str,
                 device: torch.device, seq_lens: list[int], gen: torch.Generator, stale_cache: bool) -> PagedCase:
        """A backend, its cache (zeros as the engine allocates it, or stale values as blocks freed
        by finished requests hold) and random q/k/v for every position of each sequence."""
        torch_dtype = getattr(torch, dtype)
        backend = cls(spec, block_size, torch_dtype, device)
        tables, num_blocks = shuffled_block_tables(seq_lens, block_size, gen)
        shape = backend.kv_cache_shape(num_blocks)
        cache = torch.randn(shape, generator=gen) if stale_cache else torch.zeros(shape)
        cache = cache.to(torch_dtype).to(device)

        def rand(heads: int) -> list[torch.Tensor]:  # per sequence [L, heads, D]
            return [torch.randn(n, heads, spec.head_size, generator=gen).to(torch_dtype).to(device) for n in seq_lens]

        q, k = rand(spec.num_heads), rand(spec.num_kv_heads)
        v = rand(spec.num_kv_heads) if spec.has_values else []
        weights = None
        if spec.kind == INDEXER:
            weights = [torch.randn(n, spec.num_heads, generator=gen).to(device) for n in seq_lens]
        return PagedCase(spec, block_size, dtype, backend, cache, tables, num_blocks, q, k, v, weights=weights)

    def run_step(self, case: PagedCase, label: str, seqs: list[int], starts: list[int], lens: list[int],
                 dense: bool = False) -> None:
        """One engine step: batch row ``i`` is sequence ``seqs[i]`` with ``starts[i]`` cached
        tokens and ``lens[i]`` new ones. Checks the output against the oracle (with the kit's
        spec, whatever the backend did with it) and that q/k/v are left alone (MLA: v is None
        and the output [T, H, latent_size]). Sparse MLA attends to the kit's selections, or with
        ``dense`` gets ``indices=None``; an indexer's selections are checked by
        :meth:`check_selections`."""
        spec, bs, (atol, rtol) = case.spec, case.block_size, self.tolerances[case.dtype]
        ends = [s + n for s, n in zip(starts, lens)]
        step_tables = [case.tables[b][: -(-end // bs)] for b, end in zip(seqs, ends)]  # blocks allocated so far
        common = make_common_metadata(starts, lens, step_tables, bs, case.cache.device)

        def step_rows(per_seq: list[torch.Tensor]) -> torch.Tensor:  # the step's rows, in batch order
            return torch.cat([per_seq[b][s:e] for b, s, e in zip(seqs, starts, ends)])

        # q: [T, H, D]; k, v: [T, Hkv, D] (MLA: k the new entries, no v; indexer: k its keys, no v)
        q, k, *values = (step_rows(full) for full in ((case.q, case.k, case.v) if spec.has_values else (case.q, case.k)))
        v = values[0] if values else None
        indices = None if dense or case.select is None else step_rows(case.select).to(q.device)
        weights = step_rows(case.weights) if case.weights is not None else None
        extra = [t for t in (indices, weights) if t is not None]
        inputs = [t.clone() for t in (q, k, *values, *extra)]
        with torch.inference_mode():
            metadata = case.backend.build_metadata(common)
            if spec.kind == INDEXER:
                out = case.backend.forward_index(q, k, weights, case.cache, metadata)
            elif spec.kind == SPARSE_MLA:
                lse = torch.full((q.shape[0], spec.num_heads), float("nan"), device=q.device)
                out = case.backend.forward_sparse(q, k, case.cache, metadata, indices, lse)
            else:
                out = case.backend.forward(q, k, v, case.cache, metadata)
        assert all(torch.equal(a, b) for a, b in zip(inputs, (q, k, *values, *extra))), (
            f"{label}: the backend modified its inputs (q, k, v, indices or weights)"
        )
        if spec.kind == INDEXER:
            self.check_selections(case, label, seqs, starts, ends, common, out)
            return
        out_shape = (q.shape[0], spec.num_heads, spec.latent_size) if spec.is_latent else tuple(q.shape)
        assert tuple(out.shape) == out_shape and out.dtype == q.dtype, (
            f"{label}: output {out.dtype} {tuple(out.shape)}, expected {q.dtype} {out_shape}"
        )
        expected = [self.oracle(case, b, s, e, dense) for b, s, e in zip(seqs, starts, ends)]
        if spec.kind == SPARSE_MLA:  # outputs and log-sum-exps
            expected, expected_lse = (torch.cat(parts) for parts in zip(*expected))
            torch.testing.assert_close(
                lse.cpu(), expected_lse.cpu(), atol=atol, rtol=rtol, equal_nan=False,
                msg=lambda m: f"{label}, {spec}, block size {bs}: the log-sum-exp written to lse differs\n{m}",
            )
        else:
            expected = torch.cat(expected)
        rows = common.query_start_loc.tolist()
        errors = [(b, s, n, round(float((out[r0:r1].float() - expected[r0:r1]).abs().max()), 6))
                  for b, s, n, r0, r1 in zip(seqs, starts, lens, rows, rows[1:])]
        torch.testing.assert_close(
            out.float(), expected, atol=atol, rtol=rtol,
            msg=lambda m: f"{label}, {spec}, block size {bs}: (seq, cached, new, max abs err) = {errors}\n{m}",
        )

    def check_selections(self, case: PagedCase, label: str, seqs: list[int], starts: list[int], ends: list[int],
                         common: CommonAttentionMetadata, out: torch.Tensor | None) -> None:
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
                        f"{where}: position {int(torch.nonzero(left_out).flatten()[scores[i, :p + 1][left_out].argmax()])} "
                        f"scores {highest_out:.6f}, above the lowest selected score {lowest_in:.6f}"
                    )

    def oracle(self, case: PagedCase, seq: int, start: int, end: int, dense: bool = False) -> torch.Tensor:
        """The float32 output of sequence ``seq``'s queries at positions ``start .. end - 1``."""
        spec = case.spec
        if spec.is_latent:
            indices = None if dense or case.select is None else case.select[seq][start:end]
            return naive_mla_attention(case.q[seq][start:end], case.k[seq], start, spec.scale, spec.latent_size,
                                       indices, with_lse=spec.kind == SPARSE_MLA)
        return naive_attention(case.q[seq][start:end], case.k[seq], case.v[seq], start, spec.scale,
                               spec.sliding_window)

    def run_prefix_then_new_tokens(self, case: PagedCase, context_lens: list[int], query_lens: list[int]) -> None:
        """Step 1 prefills the sequences' cached prefixes (sparse MLA: dense), step 2 runs the new
        tokens after them."""
        prefixed = [b for b, c in enumerate(context_lens) if c > 0]
        if prefixed:
            self.run_step(case, "step 1 (prefill of the cached prefixes)", prefixed, [0] * len(prefixed),
                          [context_lens[b] for b in prefixed], dense=True)
        self.run_step(case, "step 2 (new tokens after the cached prefixes)", list(range(len(query_lens))),
                      context_lens, query_lens)

    def check_random_case(self, kind: str, batch: str, block_size: int, heads: str, window: str | None,
                          dtype: str, engine_device: str) -> None:
        """Two steps over a random ragged batch in a stale cache: a prefill of the cached
        prefixes, then the new tokens after them; both steps must match the oracle."""
        gen = torch.Generator().manual_seed(zlib.crc32(f"{kind}/{batch}/{block_size}/{heads}/{window}".encode()))
        # every head layout meets every head size across the block sizes
        head_size = self.head_size(list(HEAD_LAYOUTS).index(heads) + KIT_BLOCK_SIZES.index(block_size))
        cls, device = self.setup_backend(kind, dtype, engine_device, block_size)
        # a scale other than the usual head_size ** -0.5, so that a backend ignoring spec.scale fails
        scale = head_size**-0.5 * (0.5 + float(torch.rand((), generator=gen)))
        sliding_window = WINDOWS[window](block_size) if window else None
        spec = AttentionSpec(kind, *HEAD_LAYOUTS[heads], head_size, scale, sliding_window)
        context_lens, query_lens = random_batch(batch, gen)
        seq_lens = [c + n for c, n in zip(context_lens, query_lens)]
        case = self.new_case(cls, spec, block_size, dtype, device, seq_lens, gen, stale_cache=True)
        self.run_prefix_then_new_tokens(case, context_lens, query_lens)

    def check_mla_case(self, batch: str, block_size: int, sizes: str, dtype: str, engine_device: str,
                       kind: str = MLA) -> None:
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
        spec = AttentionSpec(kind, MLA_NUM_HEADS[index % len(MLA_NUM_HEADS)], 1, head_size, scale,
                             latent_size=latent_size)
        context_lens, query_lens = random_batch(batch, gen)
        seq_lens = [c + n for c, n in zip(context_lens, query_lens)]
        case = self.new_case(cls, spec, block_size, dtype, device, [n + 1 for n in seq_lens], gen, stale_cache=True)
        if kind == SPARSE_MLA:
            case.select = random_selections([n + 1 for n in seq_lens], SPARSE_WIDTHS[index % len(SPARSE_WIDTHS)], gen)
        self.run_prefix_then_new_tokens(case, context_lens, query_lens)
        order = list(reversed(range(len(seq_lens))))
        self.run_step(case, "step 3 (one decode each after the new tokens, batch rows reversed)", order,
                      [seq_lens[b] for b in order], [1] * len(order))

    def check_index_case(self, batch: str, block_size: int, dtype: str, engine_device: str) -> None:
        """An indexer over three steps of a random ragged batch in a stale cache (prefixes, new
        tokens, a decode each with the rows reversed): every step's selections are checked."""
        gen = torch.Generator().manual_seed(zlib.crc32(f"{INDEXER}/{batch}/{block_size}".encode()))
        cls, device = self.setup_backend(INDEXER, dtype, engine_device, block_size)
        index = BATCHES.index(batch) + KIT_BLOCK_SIZES.index(block_size)
        head_size = self.head_size(index)
        scale = head_size**-0.5 * (0.5 + float(torch.rand((), generator=gen)))
        spec = AttentionSpec(INDEXER, INDEXER_NUM_HEADS[index % len(INDEXER_NUM_HEADS)], 1, head_size, scale,
                             index_topk=INDEXER_TOPKS[index % len(INDEXER_TOPKS)])
        context_lens, query_lens = random_batch(batch, gen)
        seq_lens = [c + n for c, n in zip(context_lens, query_lens)]
        case = self.new_case(cls, spec, block_size, dtype, device, [n + 1 for n in seq_lens], gen, stale_cache=True)
        self.run_prefix_then_new_tokens(case, context_lens, query_lens)
        order = list(reversed(range(len(seq_lens))))
        self.run_step(case, "step 3 (one decode each after the new tokens, batch rows reversed)", order,
                      [seq_lens[b] for b in order], [1] * len(order))

    # -- checks ---------------------------------------------------------------------------

    def test_discoverable(self) -> None:
        """The plugin registers ``backend_name``, resolving to an AttentionBackend of that name
        that declares its capabilities."""
        name = self.required("backend_name")
        cls = self.resolve(name)
        assert isinstance(cls, type) and issubclass(cls, AttentionBackend), cls
        assert cls.name == name, f"registered as {name!r} but its name attribute is {cls.name!r}"
        assert isinstance(cls.capabilities, AttentionCapabilities), cls.capabilities

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

    @pytest.mark.parametrize("batch", BATCHES)
    @pytest.mark.parametrize("block_size", KIT_BLOCK_SIZES)
    def test_indexer(self, batch: str, block_size: int, dtype: str, engine_device: str) -> None:
        """The sparse-attention indexer (``forward_index``) over paged keys: for decode, prefill
        and mixed batches, 1/4/16 query heads and index_topk 1, 7 and more than any sequence,
        each query gets min(index_topk, its positions) distinct causal positions, and none left
        out scores above one selected (``None`` is allowed only when every sequence fits)."""
        self.check_index_case(batch, block_size, dtype, engine_device)

    @pytest.mark.parametrize("shape", list(LINEAR_SHAPES))
    @pytest.mark.parametrize("batch", [*BATCHES, "long"])
    def test_linear(self, batch: str, shape: str, dtype: str, engine_device: str) -> None:
        """Kimi delta attention (``forward_linear``) continuing each request's state in its slot
        (slots shuffled, stale values in the fresh ones): a prefill of the prefixes, the new
        tokens after them and a decode each with the rows reversed; or two long sequences fed in
        chunks of 64, 1, 5 and 70 tokens. Every step's output matches the token-by-token oracle
        over the whole sequence."""
        self.check_linear_case(batch, shape, dtype, engine_device)

    def check_linear_case(self, batch: str, shape: str, dtype: str, engine_device: str) -> None:
        gen = torch.Generator().manual_seed(zlib.crc32(f"{LINEAR}/{batch}/{shape}".encode()))
        cls, device = self.setup_backend(LINEAR, dtype, engine_device, 16)
        heads, head_size, value_size, kernel = LINEAR_SHAPES[shape]
        scale = head_size**-0.5 * (0.5 + float(torch.rand((), generator=gen)))
        spec = AttentionSpec(LINEAR, heads, heads, head_size, scale, value_size=value_size, conv_kernel=kernel)
        torch_dtype = getattr(torch, dtype)
        backend = cls(spec, 16, torch_dtype, device)
        if batch == "long":
            steps = [list(enumerate(step)) for step in zip(*LONG_CHUNKS)]  # per step: [(seq, new tokens)]
            lengths = [sum(sizes) for sizes in LONG_CHUNKS]
        else:
            context_lens, query_lens = random_batch(batch, gen)
            lengths = [c + n + 1 for c, n in zip(context_lens, query_lens)]
            order = list(reversed(range(len(lengths))))
            steps = [[(b, c) for b, c in enumerate(context_lens) if c > 0],
                     list(enumerate(query_lens)), [(b, 1) for b in order]]
        num_slots = len(lengths) + 3
        slots = torch.randperm(num_slots, generator=gen)[: len(lengths)].tolist()
        state = torch.randn(backend.kv_cache_shape(num_slots), generator=gen)  # stale: fresh sequences ignore it
        state = state.to(backend.cache_dtype(torch_dtype)).to(device)
        channels = spec.conv_channels
        conv_weight = (0.5 * torch.randn(channels, kernel, generator=gen)).to(torch_dtype).to(device)
        mixed = [torch.randn(n, channels, generator=gen).to(torch_dtype).to(device) for n in lengths]
        g = [(-0.3 * torch.randn(n, heads, head_size, generator=gen).exp()).to(device) for n in lengths]
        beta = [torch.rand(n, heads, generator=gen).to(device) for n in lengths]
        done = [0] * len(lengths)
        (atol, rtol) = self.tolerances[dtype]
        atol, rtol = max(atol, 1e-4), max(rtol, 1e-4)  # a chunked form sums in another order
        for index, step in enumerate(steps):
            if not step:
                continue
            seqs, news = [b for b, _ in step], [n for _, n in step]
            starts = [done[b] for b in seqs]
            tables = [[0] * -(-(s + n) // 16) for s, n in zip(starts, news)]  # no per-token cache: any blocks
            common = make_common_metadata(starts, news, tables, 16, device, [slots[b] for b in seqs])

            def rows(per_seq):
                return torch.cat([per_seq[b][s : s + n] for b, s, n in zip(seqs, starts, news)])

            inputs = [rows(mixed), rows(g), rows(beta)]
            copies = [t.clone() for t in inputs]
            with torch.inference_mode():
                out = backend.forward_linear(inputs[0], conv_weight, inputs[1], inputs[2], state,
                                             backend.build_metadata(common))
            label = f"step {index + 1} of {batch} ({spec})"
            assert all(torch.equal(a, b) for a, b in zip(inputs, copies)), f"{label}: forward_linear modified its inputs"
            expected_shape = (sum(news), heads, value_size)
            assert tuple(out.shape) == expected_shape and out.dtype == torch_dtype, (
                f"{label}: output {out.dtype} {tuple(out.shape)}, expected {torch_dtype} {expected_shape}"
            )
            expected = torch.cat([
                naive_kda(mixed[b][: s + n].cpu(), conv_weight.cpu(), g[b][: s + n].cpu(), beta[b][: s + n].cpu(),
                          heads, head_size, value_size, scale)[s:]
                for b, s, n in zip(seqs, starts, news)
            ])
            torch.testing.assert_close(out.float().cpu(), expected, atol=atol, rtol=rtol,
                                       msg=lambda m: f"{label}: (seq, cached, new) = {step}\n{m}")
            for b, n in step:
                done[b] += n

    @pytest.mark.parametrize("block_size", KIT_BLOCK_SIZES)
    def test_kv_cache_write(self, block_size: int, dtype: str, engine_device: str) -> None:
        """forward writes the new keys and values (MLA: the new entries) into a zeroed cache
        byte-exact (after the cast) and writes nothing else; in the engine's conventional layout
        ``[2, blocks, block_size, Hkv, D]`` (MLA: ``[blocks, block_size, D]``) each lands in its
        own slot. Any layout: a later step whose batch rows are other sequences sharing those
        blocks (as prefix caching does) reads them back. Checks the first declared of MHA,
        sliding window, MLA, sparse MLA (dense) and indexer (keys, ``[blocks, block_size, D]``)."""
        kinds = self.backend_class().capabilities.kinds
        kind = next((k for k in ATTENTION_KINDS if k in kinds and k != LINEAR), None)
        if kind is None and LINEAR in kinds:
            pytest.skip("linear attention keeps one state per request, no per-token cache (test_linear checks it)")
        kind = kind or MHA
        cls, device = self.setup_backend(kind, dtype, engine_device, block_size)
        gen = torch.Generator().manual_seed(zlib.crc32(f"write/{block_size}/{dtype}".encode()))
        if kind in (MLA, SPARSE_MLA):
            latent_size, rope_size = self.mla_sizes(1)
            head_size = latent_size + rope_size
            spec = AttentionSpec(kind, 4, 1, head_size, head_size**-0.5, latent_size=latent_size)
        elif kind == INDEXER:
            head_size = self.head_size(1)
            spec = AttentionSpec(INDEXER, 4, 1, head_size, head_size**-0.5, index_topk=4)
        else:
            head_size = self.head_size(1)
            spec = AttentionSpec(kind, 4, 2, head_size, head_size**-0.5, 1000 if kind == SLIDING_WINDOW else None)
        lens = [5, 1, 2 * block_size + 1]  # prefilled first, then one decode each
        case = self.new_case(cls, spec, block_size, dtype, device, [n + 1 for n in lens], gen, stale_cache=False)
        # what the cache holds, and the conventional layout of it
        cached, what = (("k", "v"), "keys and values") if spec.has_values else (("k",), "entries")
        conventional = (case.num_blocks, block_size, head_size) if not spec.has_values else (
            2, case.num_blocks, block_size, spec.num_kv_heads, head_size)
        for t in case.k + case.v:  # no exact zeros, which would look unwritten
            t.add_(t.sign() * 0.25)

        def check_written(label: str, upto: list[int]) -> None:
            """The cache holds exactly positions 0..upto[b]-1 of every sequence's k and v (MLA: k)."""
            # each [T, Hkv, D]
            stored = [torch.cat([getattr(case, name)[b][:n] for b, n in enumerate(upto)]) for name in cached]
            written = bits(case.cache).flatten()
            written = written[written != 0].sort().values
            expected = bits(torch.cat([t.flatten() for t in stored])).sort().values
            assert written.shape == expected.shape and torch.equal(written, expected), (
                f"{label}: the cache's nonzero elements are not exactly the new {what} "
                f"({written.numel()} written, {expected.numel()} expected)"
            )
            if tuple(case.cache.shape) == conventional:
                slots = make_common_metadata([0] * 3, upto, case.tables, block_size, device).slot_mapping
                at_slots = case.cache.view(len(cached), -1, spec.num_kv_heads, head_size)[:, slots]
                assert all(torch.equal(bits(at_slots[i]), bits(t)) for i, t in enumerate(stored)), (
                    f"{label}: {what} not at their slots {slots.tolist()}"
                )

        self.run_step(case, "write step (prefill)", [0, 1, 2], [0] * 3, lens)
        check_written("after the prefill", lens)
        # batch row i is now another sequence: only the block tables lead to its keys
        self.run_step(case, "read-back step (decodes over the written blocks)", [2, 1, 0], lens[::-1], [1] * 3)
        check_written("after the decodes", [n + 1 for n in lens])

    @pytest.mark.parametrize("undeclared", ["nothing", "kind", "platform", "dtype"])
    def test_validate(self, undeclared: str) -> None:
        """validate() gives no reasons for a request within the declared capabilities, and some
        for one whose attention kind, platform or dtype is not declared."""
        cls = self.backend_class()
        caps = cls.capabilities
        kind = next((k for k in ATTENTION_KINDS if k in caps.kinds), min(caps.kinds))
        platform, dtype = min(caps.platforms), min(caps.dtypes)
        block_size = 16 if caps.block_sizes is None or 16 in caps.block_sizes else min(caps.block_sizes)
        if undeclared == "kind":
            kind = next((k for k in ATTENTION_KINDS if k not in caps.kinds), "kit_undeclared_kind")
        elif undeclared == "platform":
            platform = "kit_undeclared_platform"
        elif undeclared == "dtype":
            dtypes = ("float64", "float16", "bfloat16", "float32")
            dtype = next((d for d in dtypes if d not in caps.dtypes), "kit_undeclared_dtype")
        spec = AttentionSpec(kind, 4, 2, self.head_size(0), 0.25, 8 if kind == SLIDING_WINDOW else None)
        if spec.is_latent:  # one entry per token, its leading part the value
            latent_size, rope_size = self.mla_sizes(0)
            spec = AttentionSpec(kind, 4, 1, latent_size + rope_size, 0.25, latent_size=latent_size)
        elif kind == INDEXER:  # one key per token, a top-k to select
            spec = AttentionSpec(kind, 4, 1, self.head_size(0), 0.25, index_topk=8)
        elif kind == LINEAR:  # a state per request
            spec = AttentionSpec(kind, 4, 4, self.head_size(0), 0.25, value_size=self.head_size(0), conv_kernel=4)
        reasons = cls.validate(spec, platform=platform, dtype=dtype, block_size=block_size)
        assert isinstance(reasons, list) and all(isinstance(r, str) and r for r in reasons), reasons
        request = f"{spec}, platform {platform}, dtype {dtype}, block size {block_size}"
        if undeclared == "nothing":
            assert reasons == [], f"validate refused a declared request ({request}): {reasons}"
        else:
            assert reasons, f"validate accepted an undeclared {undeclared} ({request})"


__all__ = ["AttentionBackendTests", "make_common_metadata"]
