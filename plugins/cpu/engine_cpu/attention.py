"""Paged attention for MHA/GQA on the CPU.

In bf16, with head size 16/32/64/128/256 and a block size that is a multiple of
16, on a CPU with AVX512-BF16, the cache is *packed* for the native kernels: per
(block, kv head), keys as [D/2][block_size][2] (16 keys' values of one pair of
dims side by side) and values as [block_size/2][D][2] (two keys' values of one
dim side by side), so that both products of attention run as bf16 dot-product
instructions without horizontal sums (``csrc/packed_attention.cpp``). Decode
tokens and short prefill chunks go to ``paged_attention_packed``, one batched
call per step with no loop over sequences (a step of decode tokens alone to
``decode_attention_packed``, which writes their keys and values as it goes);
prefill chunks of at least ``LONG_PREFILL_MIN_QUERY`` tokens to the tiled
``prefill_attention``, one call for all of them. :meth:`CpuPagedAttention.gather_kv`
and :meth:`scatter_kv` read and write any slots of either layout with plain torch
indexing.

Otherwise (other dtypes or sizes) the cache is [block, offset in block, kv head,
head dim]: decode tokens and short chunks go to the native ``paged_attention``
and each long prefill chunk runs torch's flash attention over its sequence's
gathered keys and values. Where the native kernels cannot be built, the torch
path gathers every sequence's keys and values into a padded [B, max_seq_len]
view and runs one masked scaled-dot-product attention for the whole batch.

With ``batch_invariant`` (``--batch-invariant``) every query row goes to the paged kernel
(either layout), which gives each token to one thread and reduces its keys block by block in
position order: a token's output is then bitwise the same alone, in any batch and whatever
chunks its prompt was cut into. Without the native kernels, each token gets its own attention
call over exactly its keys.

Layers with attention sinks (``AttentionSpec.sinks``, GPT-OSS: one more logit per head in the
softmax, adding no value) run the packed kernels with the sink in each head's max and sum (the
online softmax starts from it); with the unpacked layout the sinks' groups attend in float32
torch code (:func:`attend_with_sinks`), batched as above or token by token when batch invariant.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.interfaces.attention import (
    MHA,
    SLIDING_WINDOW,
    AttentionBackend,
    AttentionCapabilities,
    CommonAttentionMetadata,
)

LONG_PREFILL_MIN_QUERY = 16
_NO_SINKS = torch.empty(0)


@dataclass
class PrefillChunk:
    """One sequence's prefill chunk: query rows start:end of the batch."""

    start: int
    end: int
    key_slots: torch.Tensor  # [seq_len] cache slot of each key position
    mask: torch.Tensor | None  # [query_len, seq_len] allowed positions; None: plain causal


@dataclass
class CpuAttentionMetadata:
    common: CommonAttentionMetadata
    token_seq: torch.Tensor  # [T] sequence of each token
    # the native path: the token rows for the paged kernel (an empty tensor: every row, None: no
    # row), and long prefill chunks either as sequences for the tiled prefill kernel (packed
    # cache) or as chunks for torch's flash attention
    kernel_tokens: torch.Tensor | None = None
    prefill_seqs: torch.Tensor | None = None
    # every sequence one new token, each row for the paged kernel: ``decode_attention_packed``
    decode_only: bool = False
    prefill_chunks: list[PrefillChunk] | None = None
    # the torch path only:
    token_row: torch.Tensor | None = None  # [T] row of each token within its sequence's queries
    key_slots: torch.Tensor | None = None  # [B, max_seq_len] cache slot of each key position
    mask: torch.Tensor | None = None  # [B, 1, max_query_len, max_seq_len] True where attention is allowed


def _rows_of_heads(x: torch.Tensor) -> bool:
    """[T, H, D] with each token's heads contiguous, any stride between tokens."""
    return x.stride(-1) == 1 and (x.shape[1] == 1 or x.stride(1) == x.shape[2])


class CpuPagedAttention(AttentionBackend):
    name = "cpu_paged"
    capabilities = AttentionCapabilities(
        kinds=frozenset({MHA, SLIDING_WINDOW}),
        platforms=frozenset({"cpu"}),
        dtypes=frozenset({"float32", "bfloat16", "float16"}),
        batch_invariant=True,
        sinks=True,
    )

    def __init__(self, spec, block_size, dtype, device) -> None:
        super().__init__(spec, block_size, dtype, device)
        from engine_cpu import native

        self.kernels = native.load()

    @property
    def kernels(self):
        """The native kernels module, or None (the torch path)."""
        return self._kernels

    @kernels.setter
    def kernels(self, kernels) -> None:
        self._kernels = kernels
        # whether the cache has the packed layout: fixed for a cache's lifetime (it follows the
        # backend's dtype, sizes and kernels), and read by every layer's forward
        self.packed = (
            kernels is not None
            and self.dtype == torch.bfloat16
            and kernels.packed_kv_supported(self.spec.head_size, self.block_size)
        )
        if self.spec.sinks and not self.packed:  # only the packed kernels weigh sinks: the torch path
            self._kernels = None

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        spec = self.spec
        if self.packed:  # [K/V, block, kv head, the head's block segment (see the module docstring)]
            return (2, num_blocks, spec.num_kv_heads, self.block_size * spec.head_size)
        # [K/V, block, offset in block, kv head, head dim]
        return (2, num_blocks, self.block_size, spec.num_kv_heads, spec.head_size)

    def _packed_views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K as [block, kv head, D/2, offset, 2] and V as [block, kv head, offset/2, D, 2]."""
        spec, bs = self.spec, self.block_size
        num_blocks = kv_cache.shape[1]
        keys = kv_cache[0].view(num_blocks, spec.num_kv_heads, spec.head_size // 2, bs, 2)
        values = kv_cache[1].view(num_blocks, spec.num_kv_heads, bs // 2, spec.head_size, 2)
        return keys, values

    def gather_kv(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values ([n, Hkv, D] each) held in cache ``slots``, in either layout."""
        spec = self.spec
        if not self.packed:
            key_cache, value_cache = (kv_cache[i].view(-1, spec.num_kv_heads, spec.head_size) for i in (0, 1))
            return key_cache[slots], value_cache[slots]
        keys, values = self._packed_views(kv_cache)
        block, offset = slots // self.block_size, slots % self.block_size
        k = keys[block, :, :, offset].reshape(-1, spec.num_kv_heads, spec.head_size)
        v = values[block, :, offset // 2, :, offset % 2]
        return k, v

    def scatter_kv(self, kv_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Writes ``k`` and ``v`` ([n, Hkv, D]) into cache ``slots``, in either layout."""
        spec = self.spec
        if not self.packed:
            kv_cache[0].view(-1, spec.num_kv_heads, spec.head_size)[slots] = k
            kv_cache[1].view(-1, spec.num_kv_heads, spec.head_size)[slots] = v
            return
        if k.dtype == torch.bfloat16 and v.dtype == torch.bfloat16 and slots.dtype == torch.int64:
            # the kernel that writes new tokens every step: many times faster than index_put on the views
            self.kernels.cache_write_packed(kv_cache, slots.contiguous(), k.contiguous(), v.contiguous())
            return
        keys, values = self._packed_views(kv_cache)
        block, offset = slots // self.block_size, slots % self.block_size
        keys[block, :, :, offset] = k.reshape(-1, spec.num_kv_heads, spec.head_size // 2, 2)
        values[block, :, offset // 2, :, offset % 2] = v

    def build_metadata(self, common: CommonAttentionMetadata) -> CpuAttentionMetadata:
        device = common.slot_mapping.device
        token_seq = common.token_seq
        metadata = CpuAttentionMetadata(common=common, token_seq=token_seq)
        if self.kernels is not None:
            if self.batch_invariant:  # every row to the paged kernel: one token, one thread, keys in order
                metadata.kernel_tokens, metadata.prefill_chunks = torch.empty(0, dtype=torch.int64), []
            else:
                self._split_long_prefills(metadata)
            # (one token a sequence: every row is the paged kernel's, none a long prefill's)
            metadata.decode_only = (
                self.packed
                and common.is_decode_only
                and common.slot_mapping.shape[0] == common.num_seqs  # no sequence without its token
            )
            return metadata
        metadata.token_row = common.token_row
        if self.batch_invariant:
            return metadata
        max_q, max_k, bs = common.max_query_len, common.max_seq_len, common.block_size
        key_pos = torch.arange(max_k, device=device)
        metadata.key_slots = common.block_tables[:, key_pos // bs] * bs + key_pos % bs
        # query row r of sequence b sits at position context_lens[b] + r (padding rows clamp
        # to the last real position so that no row is fully masked)
        rows = torch.arange(max_q, device=device)
        query_pos = torch.minimum(common.context_lens[:, None] + rows[None, :], common.seq_lens[:, None] - 1)
        mask = key_pos[None, None, :] <= query_pos[:, :, None]
        window = self.spec.sliding_window
        if window is not None:
            mask &= (query_pos[:, :, None] - key_pos[None, None, :]) < window
        metadata.mask = mask.unsqueeze(1)
        return metadata

    def _split_long_prefills(self, metadata: CpuAttentionMetadata) -> CpuAttentionMetadata:
        common = metadata.common
        every_row = torch.empty(0, dtype=torch.int64, device=common.slot_mapping.device)
        metadata.kernel_tokens, metadata.prefill_chunks = every_row, []
        if common.max_query_len < LONG_PREFILL_MIN_QUERY:
            return metadata
        query_lens, context_lens = common.query_lens.tolist(), common.context_lens.tolist()
        starts = common.query_start_loc.tolist()
        kernel_rows, long_seqs = [], []
        for b, (query_len, context_len) in enumerate(zip(query_lens, context_lens)):
            start, end = starts[b], starts[b + 1]
            if query_len < LONG_PREFILL_MIN_QUERY:
                kernel_rows.append(torch.arange(start, end))
            elif self.packed:
                long_seqs.append(b)
            else:
                metadata.prefill_chunks.append(self._sdpa_chunk(common, b, start, end, context_len, query_len))
        if long_seqs:
            metadata.prefill_seqs = torch.tensor(long_seqs, dtype=torch.int64)
        metadata.kernel_tokens = torch.cat(kernel_rows) if kernel_rows else None
        return metadata

    def _sdpa_chunk(self, common, b: int, start: int, end: int, context_len: int, query_len: int) -> PrefillChunk:
        bs, window = common.block_size, self.spec.sliding_window
        seq_len = context_len + query_len
        key_pos = torch.arange(seq_len)
        key_slots = common.block_tables[b, key_pos // bs] * bs + key_pos % bs
        mask = None
        if context_len or window is not None:
            query_pos = torch.arange(context_len, seq_len)
            mask = key_pos[None, :] <= query_pos[:, None]
            if window is not None:
                mask &= (query_pos[:, None] - key_pos[None, :]) < window
        return PrefillChunk(start, end, key_slots, mask)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: CpuAttentionMetadata,
        *,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        spec, common = self.spec, metadata.common
        if self.packed:
            return self._forward_packed(q, k, v, kv_cache, metadata, sinks)
        key_cache = kv_cache[0].view(-1, spec.num_kv_heads, spec.head_size)
        value_cache = kv_cache[1].view(-1, spec.num_kv_heads, spec.head_size)
        if self.kernels is not None:
            self.kernels.cache_write(key_cache, value_cache, common.slot_mapping, k.contiguous(), v.contiguous())
            q = q.contiguous()
            out = torch.empty_like(q)
            if metadata.kernel_tokens is not None:
                self.kernels.paged_attention(
                    out,
                    q,
                    kv_cache[0],
                    kv_cache[1],
                    common.block_tables,
                    common.query_start_loc,
                    common.context_lens,
                    metadata.token_seq,
                    metadata.kernel_tokens,
                    spec.scale,
                    spec.sliding_window or 0,
                )
            for chunk in metadata.prefill_chunks:
                # [1, H, query_len, D] against [1, Hkv, seq_len, D]
                out[chunk.start : chunk.end] = F.scaled_dot_product_attention(
                    q[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0),
                    key_cache[chunk.key_slots].transpose(0, 1).unsqueeze(0),
                    value_cache[chunk.key_slots].transpose(0, 1).unsqueeze(0),
                    attn_mask=chunk.mask,
                    is_causal=chunk.mask is None,
                    scale=spec.scale,
                    enable_gqa=spec.num_heads != spec.num_kv_heads,
                )[0].transpose(0, 1)
            return out
        key_cache.index_copy_(0, common.slot_mapping, k)
        value_cache.index_copy_(0, common.slot_mapping, v)
        if self.batch_invariant:
            return self._forward_torch_by_token(q, key_cache, value_cache, metadata, sinks)
        return self._forward_torch(q, key_cache, value_cache, metadata, sinks)

    def _forward_torch_by_token(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: CpuAttentionMetadata,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Batch-invariant without the native kernels: one attention call per query token over
        exactly the keys it sees, so a token's call is the same alone, in any batch and in any
        chunk of its prompt."""
        spec, common, bs = self.spec, metadata.common, self.block_size
        window = spec.sliding_window
        out = torch.empty_like(q)
        seqs, rows = metadata.token_seq.tolist(), metadata.token_row.tolist()
        context_lens = common.context_lens.tolist()
        for t, (b, row) in enumerate(zip(seqs, rows)):
            pos = context_lens[b] + row
            key_pos = torch.arange(max(0, pos - window + 1) if window else 0, pos + 1)
            slots = common.block_tables[b, key_pos // bs] * bs + key_pos % bs
            query = q[t].unsqueeze(1).unsqueeze(0)  # [1, H, 1, D]
            keys = key_cache[slots].transpose(0, 1).unsqueeze(0)
            values = value_cache[slots].transpose(0, 1).unsqueeze(0)
            if sinks is not None:
                out[t] = attend_with_sinks(query, keys, values, None, spec.scale, sinks)[0, :, 0]
                continue
            out[t] = F.scaled_dot_product_attention(
                query, keys, values, scale=spec.scale, enable_gqa=spec.num_heads != spec.num_kv_heads
            )[0, :, 0]
        return out

    def _forward_packed(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: CpuAttentionMetadata,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        spec, common = self.spec, metadata.common
        sinks = _NO_SINKS if sinks is None else sinks.float().contiguous()
        # the kernels take q, k and v as slices of a fused projection: no copies
        if not _rows_of_heads(q):
            q = q.contiguous()
        if not _rows_of_heads(k):
            k = k.contiguous()
        if not _rows_of_heads(v):
            v = v.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype)
        window = spec.sliding_window or 0
        if metadata.decode_only:
            # each token's writes and attention in one pass: its newest keys are read as written
            self.kernels.decode_attention_packed(
                out,
                q,
                k,
                v,
                kv_cache,
                common.slot_mapping,
                common.block_tables,
                common.query_start_loc,
                common.context_lens,
                metadata.token_seq,
                spec.scale,
                window,
                sinks,
            )
            return out
        self.kernels.cache_write_packed(kv_cache, common.slot_mapping, k, v)
        if metadata.kernel_tokens is not None:
            self.kernels.paged_attention_packed(
                out,
                q,
                kv_cache,
                common.block_tables,
                common.query_start_loc,
                common.context_lens,
                metadata.token_seq,
                metadata.kernel_tokens,
                spec.scale,
                window,
                sinks,
            )
        if metadata.prefill_seqs is not None:
            self.kernels.prefill_attention(
                out,
                q,
                kv_cache,
                common.block_tables,
                common.query_start_loc,
                common.context_lens,
                metadata.prefill_seqs,
                spec.scale,
                window,
                sinks,
            )
        return out

    def _forward_torch(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: CpuAttentionMetadata,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        spec, common = self.spec, metadata.common
        # keys, values: [B, Hkv, max_seq_len, D]
        keys = key_cache[metadata.key_slots].transpose(1, 2)
        values = value_cache[metadata.key_slots].transpose(1, 2)
        # queries: [T, H, D] -> padded [B, H, max_query_len, D]
        padded = q.new_zeros(common.num_seqs, common.max_query_len, spec.num_heads, spec.head_size)
        padded[metadata.token_seq, metadata.token_row] = q
        if sinks is not None:
            out = attend_with_sinks(padded.transpose(1, 2), keys, values, metadata.mask, spec.scale, sinks)
        else:
            out = F.scaled_dot_product_attention(
                padded.transpose(1, 2),
                keys,
                values,
                attn_mask=metadata.mask,
                scale=spec.scale,
                enable_gqa=spec.num_heads != spec.num_kv_heads,
            )
        # [B, H, max_query_len, D] -> [T, H, D]
        return out.transpose(1, 2)[metadata.token_seq, metadata.token_row]


def attend_with_sinks(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """Softmax attention whose every head also weighs a sink: ``sinks[h]`` is one more logit in
    head ``h``'s softmax and adds no value. In float32, returned in q's dtype.

    q: [B, H, Lq, D]; keys, values: [B, Hkv, Lk, D] (query head h reads KV head h // (H / Hkv));
    mask: [B, 1, Lq, Lk] True where attention is allowed, or None; sinks: [H]."""
    group = q.shape[1] // keys.shape[1]
    keys = keys.float().repeat_interleave(group, dim=1)
    values = values.float().repeat_interleave(group, dim=1)
    scores = (q.float() @ keys.transpose(-1, -2)) * scale  # [B, H, Lq, Lk]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink_column = sinks.float()[None, :, None, None].expand(*scores.shape[:-1], 1)
    weights = torch.cat([scores, sink_column], dim=-1).softmax(dim=-1)[..., :-1]  # the sink's share dropped
    return (weights @ values).to(q.dtype)
