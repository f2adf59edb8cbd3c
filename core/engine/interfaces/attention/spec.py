"""What one attention layer needs: its kind and sizes (:class:`AttentionSpec`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# Attention kinds. A model declares one per layer; platforms list backends per kind. Each kind's
# forward method and its contract: engine.interfaces.attention.{paged,mla,indexer,linear,mamba2}.
MHA = "mha"  # multi-head, grouped-query and multi-query attention
SLIDING_WINDOW = "sliding_window"  # MHA/GQA restricted to the last `sliding_window` keys
MLA = "mla"  # multi-head latent attention (DeepSeek)
SPARSE_MLA = "sparse_mla"  # MLA over the positions an indexer selected for each query
INDEXER = "indexer"  # DeepSeek sparse attention's lightning indexer: caches keys, returns top-k positions
LINEAR = "linear"  # Kimi delta attention: a gated delta rule with a fixed-size per-request state
MAMBA2 = "mamba2"  # the Mamba-2 (SSD) mixer's selective scan: a fixed-size per-request state
ATTENTION_KINDS = (MHA, SLIDING_WINDOW, MLA, SPARSE_MLA, INDEXER, LINEAR, MAMBA2)
RECURRENT_KINDS = (LINEAR, MAMBA2)
# Not attention: per-token values a model stores and reads back itself (DeepSeek-V4's compressor
# inputs), paged like the KV caches. The core serves it (engine.runtime.token_state, the contract
# engine.interfaces.attention.token_state); platforms list no backend for it.
TOKEN_STATE = "token_state"


@dataclass(frozen=True)
class AttentionSpec:
    """What one attention layer needs; equal specs share a KV-cache group and backend.

    ``scale`` multiplies ``q·k``; ``sliding_window`` is the number of most recent
    keys (including the query's own position) a query may attend to.

    MLA (``kind`` mla / sparse_mla) caches one latent entry per token and no separate
    values: ``num_kv_heads`` is 1, ``head_size`` is the entry's size (``kv_lora_rank +
    qk_rope_head_dim``) and ``latent_size`` its first part (``kv_lora_rank``), which
    serves as the value. Queries arrive absorbed (see :meth:`MLAAttentionBackend.forward`).

    Linear attention (``kind`` linear) keeps no per-token cache but one state per running
    request: the last ``conv_kernel - 1`` inputs of its short convolution (``num_heads ·
    (2 · head_size + value_size)`` channels) and the recurrent matrix [num_heads, head_size,
    value_size]; see :meth:`LinearAttentionBackend.forward_linear`. ``scale`` multiplies the
    normalised queries.

    A Mamba-2 mixer (``kind`` mamba2) keeps, like linear attention, one state per running
    request: the last ``conv_kernel - 1`` inputs of its short convolution (``num_heads ·
    head_size + 2 · num_groups · state_size`` channels: x, B and C) and the SSM state
    [num_heads, head_size, state_size]; ``num_kv_heads`` equals ``num_heads``, ``scale`` is
    unused (1.0) and ``dt_limit`` bounds the time steps; see
    :meth:`Mamba2Backend.forward_mamba2 <engine.interfaces.attention.mamba2.Mamba2Backend.forward_mamba2>`.

    An indexer (``kind`` indexer) caches one key per token (``num_kv_heads`` 1,
    ``head_size`` the indexer's head dim), scored by ``num_heads`` query heads with
    ``scale``; ``index_topk`` is how many positions it selects for each query (see
    :meth:`IndexerBackend.forward_index`). Its layer index is its own, separate from
    the sparse-MLA layer it serves, so its keys are their own KV-cache group.

    ``sinks`` (kinds mha and sliding_window, GPT-OSS): each query head has a learned logit that
    joins its softmax's denominator and contributes no value; the layer passes the logits to
    :meth:`PagedAttentionBackend.forward <engine.interfaces.attention.paged.PagedAttentionBackend.forward>`
    as ``sinks``, and only backends declaring ``AttentionCapabilities.sinks`` serve it.
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
    conv_kernel: int | None = None  # linear, mamba2: the short convolution's kernel size
    state_size: int | None = None  # mamba2: the SSM state's width per head channel (d_state)
    num_groups: int | None = None  # mamba2: groups of heads sharing B and C (n_groups)
    dt_limit: tuple[float, float] | None = None  # mamba2: time steps clamped to [low, high]
    # tensor parallelism: the layer's KV heads in all, when this rank's num_kv_heads are a part of
    # them (see engine.distributed.TensorParallel.kv_heads); KV tiers store blocks with all of them
    total_kv_heads: int | None = None
    # linear, mamba2 under tensor parallelism: the layer's heads (and Mamba-2's groups) in all, when
    # this rank's num_heads (num_groups) are a part of them; KV tiers store states with all of them
    total_num_heads: int | None = None
    total_num_groups: int | None = None
    sinks: bool = False  # mha, sliding_window: a learned logit per query head in the softmax's denominator

    @property
    def is_latent(self) -> bool:
        return self.kind in (MLA, SPARSE_MLA)

    @property
    def has_values(self) -> bool:
        """Whether the cache keeps values beside the keys (MLA entries, indexer keys and token
        states do not; recurrent layers keep no per-token cache at all)."""
        return self.kind not in (MLA, SPARSE_MLA, INDEXER, TOKEN_STATE, *RECURRENT_KINDS)

    @property
    def is_recurrent(self) -> bool:
        """Whether the layer keeps one state per request instead of paged per-token entries
        (linear attention, Mamba-2)."""
        return self.kind in RECURRENT_KINDS

    @property
    def conv_channels(self) -> int:
        """The short convolution's channels: linear attention's queries, keys and values;
        Mamba-2's x, B and C."""
        if self.kind == MAMBA2:
            return self.num_heads * self.head_size + 2 * self.num_groups * self.state_size
        return self.num_heads * (2 * self.head_size + self.value_size)

    def state_numel(self) -> int:
        """Recurrent kinds: the elements of one request's state (convolution inputs, then the
        recurrent matrix [num_heads, head_size, value_size] or Mamba-2's SSM state
        [num_heads, head_size, state_size])."""
        width = self.state_size if self.kind == MAMBA2 else self.value_size
        return (self.conv_kernel - 1) * self.conv_channels + self.num_heads * self.head_size * width

    def whole(self) -> AttentionSpec:
        """Recurrent kinds: the spec with all the layer's heads and groups (under tensor
        parallelism this rank's spec counts its part of them)."""
        heads = self.total_num_heads or self.num_heads
        return dataclasses.replace(
            self,
            num_heads=heads,
            num_kv_heads=heads,
            num_groups=self.total_num_groups or self.num_groups,
            total_num_heads=None,
            total_num_groups=None,
        )

    def canonical_state_numel(self) -> int:
        """Recurrent kinds: :meth:`state_numel` with all the layer's heads and groups: the size
        KV tiers store."""
        return self.whole().state_numel()

    def state_placement(self, rank: int) -> tuple[list[tuple[int, int, int]], int]:
        """Recurrent kinds under tensor parallelism (this spec being every rank's, heads and groups
        split evenly in rank order, or one group on every rank): where rank ``rank``'s state lies
        in the whole layer's. Returns its convolution channels as runs ``(first channel among all,
        first local channel, channels)`` and its first head of the recurrent matrix."""
        heads = self.num_heads
        first_head = rank * heads if (self.total_num_heads or heads) > heads else 0
        if self.kind == MAMBA2:
            all_heads, groups = self.total_num_heads or heads, self.num_groups
            all_groups = self.total_num_groups or groups
            first_group = rank * groups if all_groups > groups else 0  # else one group on every rank
            # x (a head's head_size channels), then B and C (a group's state_size channels each)
            sections = [(self.head_size, all_heads, heads, first_head)] + [
                (self.state_size, all_groups, groups, first_group)
            ] * 2
        else:
            all_heads = self.total_num_heads or heads
            widths = (self.head_size, self.head_size, self.value_size)  # queries, keys, values
            sections = [(width, all_heads, heads, first_head) for width in widths]
        runs, whole, local = [], 0, 0
        for width, total, count, first in sections:
            runs.append((whole + first * width, local, count * width))
            whole += total * width
            local += count * width
        return runs, first_head

    def kv_bytes_per_token(self, element_size: int) -> int:
        if self.is_recurrent:
            return 0
        tensors = 2 if self.has_values else 1
        return tensors * self.num_kv_heads * self.head_size * element_size


def spec_field_reasons(spec: AttentionSpec) -> list[str]:
    """Why ``spec`` lacks what its kind needs: MLA one entry per token with its value part,
    an indexer one key per token and a top-k, linear attention and Mamba-2 their state's sizes."""
    reasons = []
    if spec.is_latent or spec.kind == INDEXER:
        if spec.num_kv_heads != 1:
            what = "entry" if spec.is_latent else "key"
            reasons.append(f"{spec.kind} caches one {what} per token: num_kv_heads must be 1, not {spec.num_kv_heads}")
    if spec.is_latent and (spec.latent_size is None or not 0 < spec.latent_size <= spec.head_size):
        reasons.append(
            f"latent_size must be set within the entry's head_size {spec.head_size} (got {spec.latent_size})"
        )
    if spec.kind == INDEXER and (spec.index_topk is None or spec.index_topk < 1):
        reasons.append(f"index_topk must be a positive number of positions (got {spec.index_topk})")
    if spec.kind == LINEAR:
        if spec.value_size is None or spec.value_size < 1:
            reasons.append(f"value_size must be set (got {spec.value_size})")
        if spec.conv_kernel is None or spec.conv_kernel < 2:
            reasons.append(f"conv_kernel must be at least 2 (got {spec.conv_kernel})")
    if spec.kind == MAMBA2:
        reasons += mamba2_field_reasons(spec)
    if spec.sinks and spec.kind not in (MHA, SLIDING_WINDOW):
        reasons.append(f"attention sinks are defined for kinds {MHA} and {SLIDING_WINDOW}, not {spec.kind}")
    return reasons


def mamba2_field_reasons(spec: AttentionSpec) -> list[str]:
    reasons = []
    if spec.state_size is None or spec.state_size < 1:
        reasons.append(f"state_size must be set (got {spec.state_size})")
    if spec.num_groups is None or spec.num_groups < 1 or spec.num_heads % spec.num_groups:
        reasons.append(f"num_groups must divide num_heads {spec.num_heads} (got {spec.num_groups})")
    if spec.num_kv_heads != spec.num_heads:
        reasons.append(f"mamba2 has no separate KV heads: num_kv_heads must equal num_heads {spec.num_heads}")
    if spec.conv_kernel is None or spec.conv_kernel < 2:
        reasons.append(f"conv_kernel must be at least 2 (got {spec.conv_kernel})")
    if spec.dt_limit is None or len(spec.dt_limit) != 2 or not 0.0 <= spec.dt_limit[0] <= spec.dt_limit[1]:
        reasons.append(f"dt_limit must be (low, high) with 0 <= low <= high (got {spec.dt_limit})")
    return reasons
