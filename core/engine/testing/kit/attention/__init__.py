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

A recurrent kind (one state per request, in slots) runs steps
that continue each request's state, every output compared with a token-by-token oracle over
the whole sequence: :func:`engine.testing.oracles.naive_kda` for linear attention,
:func:`engine.testing.kit.attention.mamba2.naive_mamba2` for Mamba-2 (and the states left
in the slots with it).

One module per kind holds that kind's checks (``paged``, ``mla``, ``indexer``,
``linear``, ``mamba2``), ``common`` the checks every backend runs, ``base`` and ``steps``
what they share; :class:`AttentionBackendTests` composes them.
"""

from __future__ import annotations

# names importable from here before the kit was split per kind
from engine.interfaces.attention import (  # noqa: F401
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
from engine.testing.kit.attention.base import (
    BATCHES,
    KIT_BLOCK_SIZES,
    KIT_HEAD_SIZES,
    MLA_SIZES,
    AttentionKitBase,
    bits,
    make_common_metadata,
    random_batch,
    shuffled_block_tables,
)
from engine.testing.kit.attention.common import CommonChecks
from engine.testing.kit.attention.indexer import INDEXER_NUM_HEADS, INDEXER_TOPKS, IndexerChecks
from engine.testing.kit.attention.linear import LINEAR_SHAPES, LONG_CHUNKS, LinearChecks
from engine.testing.kit.attention.mamba2 import (
    MAMBA2_BATCHES,
    MAMBA2_SHAPES,
    REWIND_AT,
    REWIND_STEPS,
    Mamba2Case,
    Mamba2Checks,
    naive_mamba2,
)
from engine.testing.kit.attention.mla import MLA_NUM_HEADS, SPARSE_WIDTHS, MLAChecks, random_selections
from engine.testing.kit.attention.paged import HEAD_LAYOUTS, WINDOWS, PagedChecks
from engine.testing.kit.attention.steps import PagedCacheSteps, PagedCase
from engine.testing.kit.base import KitTests, capability_skip  # noqa: F401
from engine.testing.oracles import naive_attention, naive_index_scores, naive_kda, naive_mla_attention  # noqa: F401


class AttentionBackendTests(Mamba2Checks, LinearChecks, IndexerChecks, MLAChecks, PagedChecks, CommonChecks):
    """Kit for an attention backend. Set ``plugin`` and ``backend_name``; ``dtypes`` lists the
    compute dtypes to check (default float32 only): each listed dtype the backend declares in
    ``capabilities.dtypes`` is checked, a listed one it does not declare skips, and a declared
    one that is not listed is not checked, so list every dtype the backend declares.
    ``tolerances`` maps a dtype to ``(atol, rtol)`` against the float32 oracle.

    Checks of kinds the backend does not declare skip, naming the kind. (Bases in reverse of
    pytest's collection order: the common checks first, then the kinds.)"""


__all__ = [
    "BATCHES",
    "HEAD_LAYOUTS",
    "INDEXER_NUM_HEADS",
    "INDEXER_TOPKS",
    "KIT_BLOCK_SIZES",
    "KIT_HEAD_SIZES",
    "LINEAR_SHAPES",
    "LONG_CHUNKS",
    "MAMBA2_BATCHES",
    "MAMBA2_SHAPES",
    "MLA_NUM_HEADS",
    "MLA_SIZES",
    "SPARSE_WIDTHS",
    "WINDOWS",
    "AttentionBackendTests",
    "AttentionKitBase",
    "CommonChecks",
    "IndexerChecks",
    "LinearChecks",
    "MLAChecks",
    "Mamba2Case",
    "Mamba2Checks",
    "PagedCacheSteps",
    "PagedCase",
    "PagedChecks",
    "REWIND_AT",
    "REWIND_STEPS",
    "bits",
    "make_common_metadata",
    "naive_mamba2",
    "random_batch",
    "random_selections",
    "shuffled_block_tables",
]
