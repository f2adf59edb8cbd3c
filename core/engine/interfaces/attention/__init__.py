"""The attention interfaces, one module per concern.

- ``spec``: the attention kinds and :class:`AttentionSpec`, what one layer needs.
- ``metadata``: :class:`CommonAttentionMetadata`, one step's batch, built by the model runner.
- ``backend``: :class:`AttentionBackend`, the base every backend subclasses (capabilities,
  validation, the cache methods), and :class:`AttentionCapabilities`.
- one contract per kind, each an ABC over :class:`AttentionBackend` declaring the kind's
  forward method: ``paged`` (:class:`PagedAttentionBackend`: ``mha``, ``sliding_window``),
  ``mla`` (:class:`MLAAttentionBackend`, :class:`SparseMLAAttentionBackend`), ``indexer``
  (:class:`IndexerBackend`), ``linear`` (:class:`LinearAttentionBackend`) and ``token_state``
  (:class:`TokenStateBackend`, the per-token values the core stores for models).

Every name is importable from here, e.g. ``from engine.interfaces.attention import
AttentionBackend, MHA``.
"""

from engine.interfaces.attention.backend import AttentionBackend, AttentionCapabilities
from engine.interfaces.attention.indexer import IndexerBackend
from engine.interfaces.attention.linear import LinearAttentionBackend
from engine.interfaces.attention.mamba2 import Mamba2Backend
from engine.interfaces.attention.metadata import CommonAttentionMetadata
from engine.interfaces.attention.mla import MLAAttentionBackend, SparseMLAAttentionBackend
from engine.interfaces.attention.paged import PagedAttentionBackend
from engine.interfaces.attention.spec import (
    ATTENTION_KINDS,
    INDEXER,
    LINEAR,
    MAMBA2,
    MHA,
    MLA,
    RECURRENT_KINDS,
    SLIDING_WINDOW,
    SPARSE_MLA,
    TOKEN_STATE,
    AttentionSpec,
    spec_field_reasons,
)
from engine.interfaces.attention.token_state import TokenStateBackend

__all__ = [
    "ATTENTION_KINDS",
    "INDEXER",
    "LINEAR",
    "MAMBA2",
    "MHA",
    "MLA",
    "RECURRENT_KINDS",
    "SLIDING_WINDOW",
    "SPARSE_MLA",
    "TOKEN_STATE",
    "AttentionBackend",
    "AttentionCapabilities",
    "AttentionSpec",
    "CommonAttentionMetadata",
    "IndexerBackend",
    "LinearAttentionBackend",
    "MLAAttentionBackend",
    "Mamba2Backend",
    "PagedAttentionBackend",
    "SparseMLAAttentionBackend",
    "TokenStateBackend",
    "spec_field_reasons",
]
