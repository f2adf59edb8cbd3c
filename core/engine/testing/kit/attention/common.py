"""Checks every attention backend runs, whatever kinds it declares: it is discoverable, its
``validate`` agrees with its capabilities, and its cache writes land where later steps read
them (the first declared kind with a per-token cache; recurrent kinds keep none)."""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch

from engine.interfaces.attention import (
    ATTENTION_KINDS,
    INDEXER,
    LINEAR,
    MAMBA2,
    MHA,
    MLA,
    RECURRENT_KINDS,
    SLIDING_WINDOW,
    SPARSE_MLA,
    AttentionBackend,
    AttentionCapabilities,
    AttentionSpec,
)
from engine.testing.kit.attention.base import KIT_BLOCK_SIZES, bits, make_common_metadata
from engine.testing.kit.attention.steps import PagedCacheSteps


class CommonChecks(PagedCacheSteps):
    """``test_discoverable``, ``test_kv_cache_write`` and ``test_validate``."""

    def test_discoverable(self) -> None:
        """The plugin registers ``backend_name``, resolving to an AttentionBackend of that name
        that declares its capabilities."""
        name = self.required("backend_name")
        cls = self.resolve(name)
        assert isinstance(cls, type) and issubclass(cls, AttentionBackend), cls
        self.assert_named(cls, name)
        assert isinstance(cls.capabilities, AttentionCapabilities), cls.capabilities

    @pytest.mark.parametrize("block_size", KIT_BLOCK_SIZES)
    def test_kv_cache_write(self, block_size: int, dtype: str, engine_device: str) -> None:
        """forward writes the new keys and values (MLA: the new entries) into a zeroed cache
        byte-exact (after the cast) and writes nothing else; in the engine's conventional layout
        ``[2, blocks, block_size, Hkv, D]`` (MLA: ``[blocks, block_size, D]``) each lands in its
        own slot. A later step whose batch rows are other sequences (decodes over the written
        blocks) adds exactly its new tokens' K/V. Checks the first declared of MHA, sliding
        window, MLA, sparse MLA (dense) and indexer (keys, ``[blocks, block_size, D]``).

        Only the cache is checked here, not the attention outputs: those are the kind's
        checks (``test_mha``, ``test_sliding_window``, ``test_mla``, ``test_sparse_mla``,
        ``test_indexer``), whose second step reads what the first one wrote. A backend of
        recurrent kinds alone (``linear``, ``mamba2``: no per-token cache) skips it."""
        kinds = self.backend_class().capabilities.kinds
        kind = next((k for k in ATTENTION_KINDS if k in kinds and k not in RECURRENT_KINDS), None)
        if kind is None and kinds & set(RECURRENT_KINDS):
            recurrent = ", ".join(sorted(kinds & set(RECURRENT_KINDS)))
            pytest.skip(
                f"recurrent kinds ({recurrent}) keep one state per request, no per-token cache "
                "(test_linear, test_mamba2 and test_mamba2_state check it)"
            )
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
        conventional = (
            (case.num_blocks, block_size, head_size)
            if not spec.has_values
            else (2, case.num_blocks, block_size, spec.num_kv_heads, head_size)
        )
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

        self.run_step(case, "write step (prefill)", [0, 1, 2], [0] * 3, lens, check_output=False)
        check_written("after the prefill", lens)
        # batch row i is now another sequence: only slot_mapping says where its new K/V go
        self.run_step(case, "decode step over the written blocks", [2, 1, 0], lens[::-1], [1] * 3, check_output=False)
        check_written("after the decodes", [n + 1 for n in lens])

    @pytest.mark.parametrize("undeclared", ["nothing", "kind", "platform", "dtype", "sinks"])
    def test_validate(self, undeclared: str) -> None:
        """validate() gives no reasons for a request within the declared capabilities, and some
        for one whose attention kind, platform or dtype is not declared, or that has attention
        sinks where the backend does not declare them."""
        cls = self.backend_class()
        caps = cls.capabilities
        if undeclared == "sinks" and caps.sinks:
            pytest.skip("the backend declares attention sinks: no request for them to refuse")
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
        elif kind == MAMBA2:  # a state per request, B and C in groups, clamped time steps
            spec = AttentionSpec(
                kind, 4, 4, self.head_size(0), 1.0, conv_kernel=4, state_size=16, num_groups=2, dt_limit=(0.0, 8.0)
            )
        if undeclared == "sinks":
            spec = dataclasses.replace(spec, sinks=True)
        reasons = cls.validate(spec, platform=platform, dtype=dtype, block_size=block_size)
        assert isinstance(reasons, list) and all(isinstance(r, str) and r for r in reasons), reasons
        request = f"{spec}, platform {platform}, dtype {dtype}, block size {block_size}"
        if undeclared == "nothing":
            assert reasons == [], f"validate refused a declared request ({request}): {reasons}"
        else:
            assert reasons, f"validate accepted an undeclared {undeclared} ({request})"
