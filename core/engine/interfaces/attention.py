"""The AttentionBackend interface and the per-step data it receives."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar

import torch

# Attention kinds. A model declares one per layer; platforms list backends per kind.
MHA = "mha"  # multi-head, grouped-query and multi-query attention
SLIDING_WINDOW = "sliding_window"  # MHA/GQA restricted to the last `sliding_window` keys
MLA = "mla"  # multi-head latent attention (DeepSeek)
SPARSE_MLA = "sparse_mla"  # MLA over the positions an indexer selected for each query
INDEXER = "indexer"  # DeepSeek sparse attention's lightning indexer: caches keys, returns top-k positions
LINEAR = "linear"  # Kimi delta attention: a gated delta rule with a fixed-size per-request state
ATTENTION_KINDS = (MHA, SLIDING_WINDOW, MLA, SPARSE_MLA, INDEXER, LINEAR)
# Not attention: per-token values a model stores and reads back itself (DeepSeek-V4's compressor
# inputs), paged like the KV caches. The core serves it (engine.runtime.token_state); platforms
# list no backend for it.
TOKEN_STATE = "token_state"


@dataclass(frozen=True)
class AttentionSpec:
    """What one attention layer needs; equal specs share a KV-cache group and backend.

    ``scale`` multiplies ``q·k``; ``sliding_window`` is the number of most recent
    keys (including the query's own position) a query may attend to.

    MLA (``kind`` mla / sparse_mla) caches one latent entry per token and no separate
    values: ``num_kv_heads`` is 1, ``head_size`` is the entry's size (``kv_lora_rank +
    qk_rope_head_dim``) and ``latent_size`` its first part (``kv_lora_rank``), which
    serves as the value. Queries arrive absorbed (see :meth:`AttentionBackend.forward`).

    Linear attention (``kind`` linear) keeps no per-token cache but one state per running
    request: the last ``conv_kernel - 1`` inputs of its short convolution (``num_heads ·
    (2 · head_size + value_size)`` channels) and the recurrent matrix [num_heads, head_size,
    value_size]; see :meth:`AttentionBackend.forward_linear`. ``scale`` multiplies the
    normalised queries.

    An indexer (``kind`` indexer) caches one key per token (``num_kv_heads`` 1,
    ``head_size`` the indexer's head dim), scored by ``num_heads`` query heads with
    ``scale``; ``index_topk`` is how many positions it selects for each query (see
    :meth:`AttentionBackend.forward_index`). Its layer index is its own, separate from
    the sparse-MLA layer it serves, so its keys are their own KV-cache group.
    """

    kind: str
    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    sliding_window: int | None = None
    latent_size: int | None = None  # MLA: the leading part of a cache entry that is the value
    index_topk: int | None = None  # indexer: positions selected for each query
    value_size: int | None = None  # linear: the recurrent state's value width
    conv_kernel: int | None = None  # linear: the short convolution's kernel size
    # tensor parallelism: the layer's KV heads in all, when this rank's num_kv_heads are a part of
    # them (see engine.distributed.TensorParallel.kv_heads); KV tiers store blocks with all of them
    total_kv_heads: int | None = None

    @property
    def is_latent(self) -> bool:
        return self.kind in (MLA, SPARSE_MLA)

    @property
    def has_values(self) -> bool:
        """Whether the cache keeps values beside the keys (MLA entries, indexer keys and token
        states do not; linear attention keeps no per-token cache at all)."""
        return self.kind not in (MLA, SPARSE_MLA, INDEXER, TOKEN_STATE, LINEAR)

    @property
    def is_recurrent(self) -> bool:
        """Whether the layer keeps one state per request instead of paged per-token entries."""
        return self.kind == LINEAR

    @property
    def conv_channels(self) -> int:
        """Linear: the short convolution's channels, queries, keys and values."""
        return self.num_heads * (2 * self.head_size + self.value_size)

    def state_numel(self) -> int:
        """Linear: the elements of one request's state (convolution inputs, recurrent matrix)."""
        return (self.conv_kernel - 1) * self.conv_channels + self.num_heads * self.head_size * self.value_size

    def kv_bytes_per_token(self, element_size: int) -> int:
        if self.is_recurrent:
            return 0
        tensors = 2 if self.has_values else 1
        return tensors * self.num_kv_heads * self.head_size * element_size


def spec_field_reasons(spec: AttentionSpec) -> list[str]:
    """Why ``spec`` lacks what its kind needs: MLA one entry per token with its value part,
    an indexer one key per token and a top-k, linear attention its state's sizes."""
    reasons = []
    if spec.is_latent or spec.kind == INDEXER:
        if spec.num_kv_heads != 1:
            what = "entry" if spec.is_latent else "key"
            reasons.append(f"{spec.kind} caches one {what} per token: num_kv_heads must be 1, not {spec.num_kv_heads}")
    if spec.is_latent and (spec.latent_size is None or not 0 < spec.latent_size <= spec.head_size):
        reasons.append(f"latent_size must be set within the entry's head_size {spec.head_size} "
                       f"(got {spec.latent_size})")
    if spec.kind == INDEXER and (spec.index_topk is None or spec.index_topk < 1):
        reasons.append(f"index_topk must be a positive number of positions (got {spec.index_topk})")
    if spec.kind == LINEAR:
        if spec.value_size is None or spec.value_size < 1:
            reasons.append(f"value_size must be set (got {spec.value_size})")
        if spec.conv_kernel is None or spec.conv_kernel < 2:
            reasons.append(f"conv_kernel must be at least 2 (got {spec.conv_kernel})")
    return reasons


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


@dataclass
class CommonAttentionMetadata:
    """One step's flattened varlen batch, built once by the model runner.

    All tensors are int64 on the device. ``B`` sequences, ``T`` tokens; sequence
    ``i`` owns tokens ``query_start_loc[i]:query_start_loc[i+1]``, which sit at
    positions ``context_lens[i] .. seq_lens[i]-1`` of that sequence.

    - ``query_start_loc``: [B + 1]
    - ``query_lens``: [B] new tokens this step
    - ``context_lens``: [B] tokens already in the cache before this step
    - ``seq_lens``: [B] = context_lens + query_lens
    - ``block_tables``: [B, max_blocks] physical block ids (padding entries are 0
      and never read for positions < seq_lens)
    - ``slot_mapping``: [T] cache slot (block * block_size + offset) of each new token
    - ``state_slots``: [B] each sequence's recurrent-state slot (models with linear attention
      layers; None otherwise)

    Per token, computed on first use and shared by every backend of the step: ``token_seq``
    [T] its sequence, ``token_row`` [T] its index among its sequence's new tokens,
    ``token_pos`` [T] its position in its sequence.
    """

    query_start_loc: torch.Tensor
    query_lens: torch.Tensor
    context_lens: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    block_size: int
    state_slots: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return self.query_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    @cached_property
    def token_seq(self) -> torch.Tensor:
        sequences = torch.arange(self.num_seqs, device=self.query_lens.device)
        return sequences if self.is_decode_only else torch.repeat_interleave(sequences, self.query_lens)

    @cached_property
    def token_row(self) -> torch.Tensor:
        return torch.arange(self.num_tokens, device=self.query_lens.device) - self.query_start_loc[self.token_seq]

    @cached_property
    def token_pos(self) -> torch.Tensor:
        return self.context_lens[self.token_seq] + self.token_row


class AttentionBackend(ABC):
    """Runs attention over a paged KV cache for one KV-cache group.

    One instance is created per group of layers with equal :class:`AttentionSpec`
    (``__init__(spec, block_size, dtype, device)``). Per step,
    :meth:`build_metadata` is called once and its result passed to
    :meth:`forward` for every layer of the group. No hooks are called per step.
    """

    name: ClassVar[str]
    capabilities: ClassVar[AttentionCapabilities]

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
        if spec.kind in caps.kinds:
            reasons += cls.spec_reasons(spec)
        return reasons

    @abstractmethod
    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of one layer's cache tensor for ``num_blocks`` blocks (linear attention: for
        ``num_blocks`` request state slots)."""

    def cache_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype of this backend's cache tensors for compute dtype ``dtype`` (linear attention
        keeps its states in float32)."""
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

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, metadata: Any
    ) -> torch.Tensor:
        """Write ``k``/``v`` into ``kv_cache`` at the step's slots, then attend.

        q: [T, num_heads, head_size]; k, v: [T, num_kv_heads, head_size], all in
        the compute dtype. Each token attends causally to its sequence's cached
        and new keys (and only the last ``sliding_window`` of them when set).
        Returns [T, num_heads, head_size]. Mutates ``kv_cache`` only.

        MLA (absorbed form): q is [T, num_heads, head_size], each head's query already
        multiplied into the latent space (``[W_UKᵀ q_nope; q_rope]``); k is [T, 1,
        head_size], the new cache entries ``[c; k_rope]``; v is None. Scores are
        ``scale · q·entry``, the values are the entries' first ``latent_size`` dims, and
        the result is [T, num_heads, latent_size] (the model applies ``W_UV``).
        """

    def forward_sparse(
        self, q: torch.Tensor, k: torch.Tensor, kv_cache: torch.Tensor, metadata: Any, indices: torch.Tensor | None,
        lse: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Sparse MLA (kind ``sparse_mla``): write the new entries, then attend each query to
        the positions ``indices`` selects. Backends declaring ``sparse_mla`` implement this.

        q, k and the result are as for MLA in :meth:`forward`. ``indices``: [T, n] int64,
        positions within each query's own sequence (``0 .. seq_len - 1``, at or before the
        query's position), in any order, padded with ``-1``. ``None`` means every query
        selects all of its causal positions (what an indexer returns when no sequence is
        longer than its ``index_topk``): plain MLA. A row selecting nothing (all ``-1``)
        gets zeros. ``lse``: an optional [T, num_heads] float32 tensor the backend fills
        with each row's ``log Σ exp(scale · q·entry)`` over its selected positions (``-inf``
        for a row selecting nothing), so that a model can merge this attention with another
        (DeepSeek-V4 merges a sliding window, compressed entries and attention sinks).
        Mutates ``kv_cache`` and ``lse`` only.
        """
        raise NotImplementedError(f"attention backend {self.name!r} does not implement sparse MLA (forward_sparse)")

    def forward_linear(
        self, mixed_qkv: torch.Tensor, conv_weight: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
        state: torch.Tensor, metadata: Any,
    ) -> torch.Tensor:
        """Kimi delta attention (kind ``linear``) over the step's tokens, continuing each
        sequence's state. Backends declaring ``linear`` implement this.

        mixed_qkv: [T, conv_channels], the projections of queries, keys and values before the
        short convolution; conv_weight: [conv_channels, conv_kernel]; g: [T, H, head_size]
        float32, the log of each channel's decay (<= 0); beta: [T, H] float32. ``state``
        holds every slot's state (the backend's ``kv_cache_shape(num_slots)``); sequence ``b``
        uses slot ``metadata.state_slots[b]`` and starts from zeros when it has no cached
        tokens (``context_lens[b] == 0``), whatever the slot held.

        Per sequence: a causal depthwise convolution over its inputs (the last ``conv_kernel
        - 1`` kept from earlier steps), SiLU, split into q, k ([H, head_size] each) and v
        ([H, value_size]); q and k L2-normalised per head (``x / sqrt(Σx² + 1e-6)``), q times
        ``scale``; then per token, in float32,
        ``S = (I - β k kᵀ) · diag(exp(g)) · S + β k vᵀ`` and ``o = Sᵀ q``.
        Returns o [T, H, value_size] in mixed_qkv's dtype; mutates ``state`` only (the
        convolution inputs and S after each sequence's last token).
        """
        raise NotImplementedError(f"attention backend {self.name!r} does not implement linear attention (forward_linear)")

    def forward_index(
        self, q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, kv_cache: torch.Tensor, metadata: Any
    ) -> torch.Tensor | None:
        """The indexer of DeepSeek sparse attention (kind ``indexer``): write the new keys,
        then select each query's ``index_topk`` positions. Backends declaring ``indexer``
        implement this.

        q: [T, num_heads, head_size]; k: [T, 1, head_size] the new keys; weights:
        [T, num_heads] float32. The score of the key at position ``j`` for query ``t`` is
        ``Σ_h weights[t, h] · relu(scale · q[t, h]·key_j)``, over the positions ``j`` at or
        before the query's own (float32 accumulation). Returns [T, index_topk] int64: the
        positions of each query's ``index_topk`` highest scores, in any order (ties broken
        either way), padded with ``-1`` where the query has fewer positions; or ``None``
        when no sequence of the step is longer than ``index_topk`` (every query then selects
        all of its positions). Mutates ``kv_cache`` only.
        """
        raise NotImplementedError(f"attention backend {self.name!r} does not implement the indexer (forward_index)")
