"""One engine step over a backend that caches per token (every kind but the recurrent ones,
linear attention and Mamba-2): a :class:`PagedCase` holds the backend, its cache and every
sequence's inputs by position, and :meth:`PagedCacheSteps.run_step` runs a step through the
kind's forward method and checks the result against the oracle."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.interfaces.attention import INDEXER, SPARSE_MLA, AttentionBackend, AttentionSpec, CommonAttentionMetadata
from engine.testing.kit.attention.base import AttentionKitBase, make_common_metadata, shuffled_block_tables
from engine.testing.oracles import naive_attention, naive_mla_attention


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
    sinks: torch.Tensor | None = None  # spec.sinks: [H] float32, each head's sink logit


class PagedCacheSteps(AttentionKitBase):
    """Builds cases and runs steps for the checks of every per-token cache kind."""

    def new_case(
        self,
        cls: type[AttentionBackend],
        spec: AttentionSpec,
        block_size: int,
        dtype: str,
        device: torch.device,
        seq_lens: list[int],
        gen: torch.Generator,
        stale_cache: bool,
    ) -> PagedCase:
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
        weights = sinks = None
        if spec.kind == INDEXER:
            weights = [torch.randn(n, spec.num_heads, generator=gen).to(device) for n in seq_lens]
        if spec.sinks:  # around the scores' range, so that they take from a little to most of the weight
            sinks = (2 * torch.randn(spec.num_heads, generator=gen)).to(device)
        return PagedCase(
            spec, block_size, dtype, backend, cache, tables, num_blocks, q, k, v, weights=weights, sinks=sinks
        )

    def run_step(
        self,
        case: PagedCase,
        label: str,
        seqs: list[int],
        starts: list[int],
        lens: list[int],
        dense: bool = False,
        check_output: bool = True,
    ) -> None:
        """One engine step: batch row ``i`` is sequence ``seqs[i]`` with ``starts[i]`` cached
        tokens and ``lens[i]`` new ones. Checks the output against the oracle (with the kit's
        spec, whatever the backend did with it) and that q/k/v are left alone (MLA: v is None
        and the output [T, H, latent_size]). Sparse MLA attends to the kit's selections, or with
        ``dense`` gets ``indices=None``; an indexer's selections are checked by
        :meth:`check_selections`. Without ``check_output`` the step only runs (for checks of
        what it writes into the cache)."""
        spec, bs, (atol, rtol) = case.spec, case.block_size, self.tolerances[case.dtype]
        ends = [s + n for s, n in zip(starts, lens)]
        step_tables = [case.tables[b][: -(-end // bs)] for b, end in zip(seqs, ends)]  # blocks allocated so far
        common = make_common_metadata(starts, lens, step_tables, bs, case.cache.device)

        def step_rows(per_seq: list[torch.Tensor]) -> torch.Tensor:  # the step's rows, in batch order
            return torch.cat([per_seq[b][s:e] for b, s, e in zip(seqs, starts, ends)])

        # q: [T, H, D]; k, v: [T, Hkv, D] (MLA: k the new entries, no v; indexer: k its keys, no v)
        q, k, *values = (
            step_rows(full) for full in ((case.q, case.k, case.v) if spec.has_values else (case.q, case.k))
        )
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
            elif case.sinks is not None:
                out = case.backend.forward(q, k, v, case.cache, metadata, sinks=case.sinks.clone())
            else:
                out = case.backend.forward(q, k, v, case.cache, metadata)
        if not check_output:
            return
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
                lse.cpu(),
                expected_lse.cpu(),
                atol=atol,
                rtol=rtol,
                equal_nan=False,
                msg=lambda m: f"{label}, {spec}, block size {bs}: the log-sum-exp written to lse differs\n{m}",
            )
        else:
            expected = torch.cat(expected)
        rows = common.query_start_loc.tolist()
        errors = [
            (b, s, n, round(float((out[r0:r1].float() - expected[r0:r1]).abs().max()), 6))
            for b, s, n, r0, r1 in zip(seqs, starts, lens, rows, rows[1:])
        ]
        torch.testing.assert_close(
            out.float(),
            expected,
            atol=atol,
            rtol=rtol,
            msg=lambda m: f"{label}, {spec}, block size {bs}: (seq, cached, new, max abs err) = {errors}\n{m}",
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
        """An indexer step's result, checked by the indexer's checks
        (:meth:`engine.testing.kit.attention.indexer.IndexerChecks.check_selections`)."""
        raise NotImplementedError(f"{type(self).__name__} runs no indexer checks (IndexerChecks)")

    def oracle(self, case: PagedCase, seq: int, start: int, end: int, dense: bool = False) -> torch.Tensor:
        """The float32 output of sequence ``seq``'s queries at positions ``start .. end - 1``."""
        spec = case.spec
        if spec.is_latent:
            indices = None if dense or case.select is None else case.select[seq][start:end]
            return naive_mla_attention(
                case.q[seq][start:end],
                case.k[seq],
                start,
                spec.scale,
                spec.latent_size,
                indices,
                with_lse=spec.kind == SPARSE_MLA,
            )
        return naive_attention(
            case.q[seq][start:end], case.k[seq], case.v[seq], start, spec.scale, spec.sliding_window, case.sinks
        )

    def run_prefix_then_new_tokens(self, case: PagedCase, context_lens: list[int], query_lens: list[int]) -> None:
        """Step 1 prefills the sequences' cached prefixes (sparse MLA: dense), step 2 runs the new
        tokens after them."""
        prefixed = [b for b, c in enumerate(context_lens) if c > 0]
        if prefixed:
            self.run_step(
                case,
                "step 1 (prefill of the cached prefixes)",
                prefixed,
                [0] * len(prefixed),
                [context_lens[b] for b in prefixed],
                dense=True,
            )
        self.run_step(
            case,
            "step 2 (new tokens after the cached prefixes)",
            list(range(len(query_lens))),
            context_lens,
            query_lens,
        )
