"""The base of every attention backend: capabilities, construction, validation and the cache
methods the engine calls whatever the kind (:class:`AttentionBackend`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from engine.interfaces.attention.metadata import CommonAttentionMetadata
from engine.interfaces.attention.spec import AttentionSpec, spec_field_reasons


@dataclass(frozen=True)
class AttentionCapabilities:
    """What a backend supports; read by selection and by the conformance kit.

    ``None`` for ``head_sizes`` / ``block_sizes`` means any. ``kv_cache_dtypes``
    uses ``"auto"`` for "same as the compute dtype".
    """

    kinds: frozenset[str]
    platforms: frozenset[str]
    dtypes: frozenset[str]
    kv_cache_dtypes: frozenset[str] = frozenset({"auto"})
    head_sizes: frozenset[int] | None = None
    block_sizes: frozenset[int] | None = None
    # whether the backend has a batch-invariant mode (see AttentionBackend.batch_invariant)
    batch_invariant: bool = False
    # whether a decode step's build_metadata and forward can be captured in a device graph
    # (no host synchronisation: engine.runtime.graphs); decode steps run eagerly otherwise
    graph_capturable: bool = True
    # whether forward takes attention sinks (``AttentionSpec.sinks``: a learned logit per query
    # head in the softmax's denominator, see PagedAttentionBackend.forward)
    sinks: bool = False


class AttentionBackend(ABC):
    """Runs attention over a paged KV cache for one KV-cache group.

    One instance is created per group of layers with equal :class:`AttentionSpec`
    (``__init__(spec, block_size, dtype, device)``). Per step,
    :meth:`build_metadata` is called once and its result passed to the kind's
    forward method for every layer of the group. No hooks are called per step.

    Each kind's forward method and its contract (shapes, dtypes, what it mutates) is
    declared by that kind's ABC, a subclass of this one:
    :class:`~engine.interfaces.attention.paged.PagedAttentionBackend` (``mha``,
    ``sliding_window``: :meth:`forward`),
    :class:`~engine.interfaces.attention.mla.MLAAttentionBackend` (``mla``: :meth:`forward`),
    :class:`~engine.interfaces.attention.mla.SparseMLAAttentionBackend` (``sparse_mla``:
    :meth:`forward_sparse`), :class:`~engine.interfaces.attention.indexer.IndexerBackend`
    (``indexer``: :meth:`forward_index`) and
    :class:`~engine.interfaces.attention.linear.LinearAttentionBackend` (``linear``:
    :meth:`forward_linear`) and :class:`~engine.interfaces.attention.mamba2.Mamba2Backend`
    (``mamba2``: :meth:`forward_mamba2`). A backend subclasses the ABC of each kind it declares in
    ``capabilities.kinds`` (those that attend, paged and MLA, first: their abstract
    :meth:`forward` is then the one it must define), or this class directly, defining
    :meth:`forward` in any case and the other methods of its kinds.
    """

    name: ClassVar[str]
    capabilities: ClassVar[AttentionCapabilities]
    # Set by the engine (``--batch-invariant``) on a backend whose capabilities declare
    # ``batch_invariant``, before its first step: each query token's output must then be bitwise
    # the same whatever else is in the batch and however its prompt was cut into chunks (one
    # kernel for every row, keys reduced in an order fixed by their positions alone).
    batch_invariant: bool = False
    # Set by the engine (``--kv-cache-dtype``) before the cache is allocated, to one of the
    # backend's ``capabilities.kv_cache_dtypes``: "auto" keeps the compute dtype, "fp8" asks
    # for float8_e4m3fn entries (``cache_dtype`` answers it), read back times ``k_scale`` /
    # ``v_scale`` (per-tensor factors, 1.0 unless set).
    kv_cache_dtype: str = "auto"
    k_scale: float = 1.0
    v_scale: float = 1.0

    def __init__(self, spec: AttentionSpec, block_size: int, dtype: torch.dtype, device: torch.device) -> None:
        """Raises ``ValueError`` when :meth:`spec_reasons` finds ``spec`` unservable."""
        self.spec = spec
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        reasons = self.spec_reasons(spec)
        if reasons:
            raise ValueError(f"{self.name} cannot serve {spec}: {'; '.join(reasons)}.")

    @classmethod
    def spec_reasons(cls, spec: AttentionSpec) -> list[str]:
        """Reasons a spec of a declared kind is malformed (an MLA spec without ``latent_size``,
        a linear one without ``value_size``, ...: :func:`spec_field_reasons`); a backend with
        checks of its own extends it. :meth:`validate` and the constructor use it."""
        return spec_field_reasons(spec)

    @classmethod
    def validate(
        cls, spec: AttentionSpec, *, platform: str, dtype: str, block_size: int, kv_cache_dtype: str = "auto"
    ) -> list[str]:
        """Reasons this backend cannot serve ``spec``; an empty list means usable."""
        caps = cls.capabilities
        reasons = []
        if spec.kind not in caps.kinds:
            reasons.append(f"attention kind {spec.kind!r} not supported (supports {', '.join(sorted(caps.kinds))})")
        if platform not in caps.platforms:
            reasons.append(f"platform {platform!r} not supported (supports {', '.join(sorted(caps.platforms))})")
        if dtype not in caps.dtypes:
            reasons.append(f"dtype {dtype} not supported (supports {', '.join(sorted(caps.dtypes))})")
        if kv_cache_dtype not in caps.kv_cache_dtypes:
            reasons.append(f"KV-cache dtype {kv_cache_dtype} not supported")
        if caps.head_sizes is not None and spec.head_size not in caps.head_sizes:
            reasons.append(f"head size {spec.head_size} not supported (supports {sorted(caps.head_sizes)})")
        if caps.block_sizes is not None and block_size not in caps.block_sizes:
            reasons.append(f"block size {block_size} not supported (supports {sorted(caps.block_sizes)})")
        if spec.sinks and not caps.sinks:
            reasons.append("attention sinks not supported (AttentionCapabilities.sinks)")
        if spec.kind in caps.kinds:
            reasons += cls.spec_reasons(spec)
        return reasons

    # -- the cache, whatever the kind ------------------------------------------------------

    @abstractmethod
    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of one layer's cache tensor for ``num_blocks`` blocks (recurrent kinds, linear and mamba2: for
        ``num_blocks`` request state slots)."""

    def cache_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype of this backend's cache tensors for compute dtype ``dtype`` (linear attention and
        Mamba-2 keep their states in float32)."""
        return dtype

    def gather_kv(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the keys and values ([n, num_kv_heads, head_size] each) held in cache
        ``slots`` (``block * block_size + offset``), for KV tiers.

        The default serves slot-major layouts: ``kv_cache[0]`` (keys) and ``kv_cache[1]``
        (values) each flatten to ``[slots, num_kv_heads, head_size]``, as
        ``(2, num_blocks, block_size, Hkv, D)`` or ``(2, num_blocks * block_size, Hkv, D)`` do.
        A backend with any other layout overrides this and :meth:`scatter_kv`.
        """
        spec = self.spec
        return tuple(kv_cache[i].reshape(-1, spec.num_kv_heads, spec.head_size)[slots] for i in (0, 1))

    def scatter_kv(self, kv_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k`` and ``v`` ([n, num_kv_heads, head_size]) into cache ``slots``; the
        inverse of :meth:`gather_kv` (same default layout)."""
        spec = self.spec
        for i, x in ((0, k), (1, v)):
            flat = kv_cache[i].view(-1, spec.num_kv_heads, spec.head_size)  # a view, or an error: never a copy
            flat[slots] = x

    @abstractmethod
    def build_metadata(self, common: CommonAttentionMetadata) -> Any:
        """Derive whatever this backend needs for the step; called once per step."""

    # -- each kind's forward method (contracts: the kinds' ABCs) ---------------------------

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, kv_cache: torch.Tensor, metadata: Any
    ) -> torch.Tensor:
        """Write ``k``/``v`` into ``kv_cache`` at the step's slots, then attend: kinds ``mha`` and
        ``sliding_window`` (:meth:`PagedAttentionBackend.forward
        <engine.interfaces.attention.paged.PagedAttentionBackend.forward>`) and ``mla``, absorbed
        (:meth:`MLAAttentionBackend.forward <engine.interfaces.attention.mla.MLAAttentionBackend.forward>`).
        A backend of no attending kind raises ``NotImplementedError`` (the ABCs of the other
        kinds do so for it)."""

    def forward_sparse(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: Any,
        indices: torch.Tensor | None,
        lse: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Sparse MLA (kind ``sparse_mla``), contract :meth:`SparseMLAAttentionBackend.forward_sparse
        <engine.interfaces.attention.mla.SparseMLAAttentionBackend.forward_sparse>`. Backends
        declaring ``sparse_mla`` implement this."""
        raise NotImplementedError(f"attention backend {self.name!r} does not implement sparse MLA (forward_sparse)")

    def forward_linear(
        self,
        mixed_qkv: torch.Tensor,
        conv_weight: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
        metadata: Any,
    ) -> torch.Tensor:
        """Kimi delta attention (kind ``linear``), contract :meth:`LinearAttentionBackend.forward_linear
        <engine.interfaces.attention.linear.LinearAttentionBackend.forward_linear>`. Backends
        declaring ``linear`` implement this."""
        raise NotImplementedError(
            f"attention backend {self.name!r} does not implement linear attention (forward_linear)"
        )

    def forward_mamba2(
        self,
        xbc: torch.Tensor,
        conv_weight: torch.Tensor,
        conv_bias: torch.Tensor | None,
        dt: torch.Tensor,
        dt_bias: torch.Tensor,
        A: torch.Tensor,
        D: torch.Tensor,
        state: torch.Tensor,
        metadata: Any,
    ) -> torch.Tensor:
        """The Mamba-2 selective scan (kind ``mamba2``), contract :meth:`Mamba2Backend.forward_mamba2
        <engine.interfaces.attention.mamba2.Mamba2Backend.forward_mamba2>`. Backends declaring
        ``mamba2`` implement this."""
        raise NotImplementedError(
            f"attention backend {self.name!r} does not implement the Mamba-2 scan (forward_mamba2)"
        )

    def forward_index(
        self, q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, kv_cache: torch.Tensor, metadata: Any
    ) -> torch.Tensor | None:
        """The indexer of DeepSeek sparse attention (kind ``indexer``), contract
        :meth:`IndexerBackend.forward_index <engine.interfaces.attention.indexer.IndexerBackend.forward_index>`.
        Backends declaring ``indexer`` implement this."""
        raise NotImplementedError(f"attention backend {self.name!r} does not implement the indexer (forward_index)")
