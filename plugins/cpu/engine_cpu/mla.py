"""Paged multi-head latent attention (MLA, absorbed form) on the CPU.

The cache holds one entry per token, ``[c; k_rope]`` of ``head_size = latent_size +
rope dims``, as [block, offset in block, head_size]; there are no separate values.
Every head's absorbed query scores the same entries, so a step is multi-query
attention with one KV head whose values are the entries' first ``latent_size``
dims. It runs as torch's scaled-dot-product attention with the whole entry as the
value (the CPU flash kernel wants equal key and value sizes) and keeps the first
``latent_size`` dims of the result; that kernel accumulates and takes the softmax
in float32 for bf16 inputs, and tiles the keys, so no [H, n, L] score tensor is
materialised.

A step's sequences split in two groups, each one batched call with no Python
loop over sequences:

- decode rows (one new token): the heads are the query rows of a [1, H] block per
  sequence, against that sequence's gathered entries padded to the longest;
- prefill chunks (several new tokens, maybe after a cached prefix): queries
  padded to [chunks, H, longest chunk], entries to the longest sequence, with a
  causal mask offset by each chunk's cached length.

Sparse MLA (kind ``sparse_mla``) attends each query to the positions its indexer
selected: the selected entries are gathered per query ([tokens, n, head_size], in
chunks of tokens that bound that copy) and scored in float32, unselected padding
masked out, keeping each row's log-sum-exp when the model asks for it. Without
indices (no sequence longer than the indexer's top-k) it is the dense path above.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.interfaces.attention import (
    MLA,
    SPARSE_MLA,
    AttentionBackend,
    AttentionCapabilities,
    CommonAttentionMetadata,
)


@dataclass
class MlaGroup:
    """Some sequences of the step as one padded batch over their gathered cache entries.

    ``tokens`` are their query rows in the step's batch; query ``i`` of them is row
    ``row[i]`` of padded sequence ``seq[i]`` (decode groups: one row each, so
    ``seq`` is ``arange`` and ``row`` zeros)."""

    tokens: torch.Tensor  # [n] batch rows of the group's queries
    seq: torch.Tensor  # [n] padded sequence of each query
    row: torch.Tensor  # [n] row of each query within its sequence's chunk
    key_slots: torch.Tensor  # [b, max_seq_len] cache slot of each key position
    # [b, 1, max_query_len, max_seq_len] True where attention is allowed; None: plain causal
    # (one chunk from position 0, as a fresh prompt is)
    mask: torch.Tensor | None
    max_query_len: int


# sparse MLA gathers the selected entries of this many (token, selected position, dim) elements at a time
SPARSE_GATHER_ELEMENTS = 1 << 24


@dataclass
class CpuMlaMetadata:
    common: CommonAttentionMetadata
    decode: MlaGroup | None  # sequences with one new token
    prefill: MlaGroup | None  # sequences with several
    token_seq: torch.Tensor | None = None  # sparse MLA: [T] the sequence of each token
    token_pos: torch.Tensor | None = None  # sparse MLA: [T] the position of each token in its sequence


class CpuMlaAttention(AttentionBackend):
    name = "cpu_mla"
    capabilities = AttentionCapabilities(
        kinds=frozenset({MLA, SPARSE_MLA}),
        platforms=frozenset({"cpu"}),
        dtypes=frozenset({"float32", "bfloat16"}),
    )

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        # [block, offset in block, entry]
        return (num_blocks, self.block_size, self.spec.head_size)

    def gather_kv(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The entries held in cache ``slots`` as keys [n, 1, head_size], and an empty value
        tensor [n, 0, head_size]: MLA caches no separate values (KV tiers carry the entries
        alone)."""
        entries = kv_cache.view(-1, 1, self.spec.head_size)[slots]
        return entries, entries.new_empty(entries.shape[0], 0, self.spec.head_size)

    def scatter_kv(self, kv_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> None:
        """Writes the entries ``k`` [n, 1, head_size] into cache ``slots``; ``v`` must be None
        or empty (the inverse of :meth:`gather_kv`)."""
        if v is not None and v.numel():
            raise ValueError(f"cpu_mla caches no values: got v of shape {tuple(v.shape)}; pass None or an empty v.")
        kv_cache.view(-1, 1, self.spec.head_size)[slots] = k

    def build_metadata(self, common: CommonAttentionMetadata) -> CpuMlaMetadata:
        token_seq = token_pos = None
        if self.spec.kind == SPARSE_MLA:
            token_seq, token_pos = common.token_seq, common.token_pos
        if common.is_decode_only:  # token i belongs to sequence i
            seqs = torch.arange(common.num_seqs, device=common.slot_mapping.device)
            return CpuMlaMetadata(
                common, decode_group(common, seqs, seqs, common.max_seq_len), None, token_seq, token_pos
            )
        is_decode = common.query_lens == 1
        decode_seqs, prefill_seqs = is_decode.nonzero().flatten(), (~is_decode).nonzero().flatten()
        decode = None
        if decode_seqs.numel():
            max_seq_len = int(common.seq_lens[decode_seqs].max())
            decode = decode_group(common, decode_seqs, common.query_start_loc[decode_seqs], max_seq_len)
        return CpuMlaMetadata(common, decode, prefill_group(common, prefill_seqs), token_seq, token_pos)

    def forward_sparse(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: CpuMlaMetadata,
        indices: torch.Tensor | None,
        lse: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: [T, H, head_size] absorbed queries; k: [T, 1, head_size] new entries; indices:
        [T, n] selected positions (-1 padding) or None for all; lse: [T, H] to fill, or None.
        Returns [T, H, latent_size]."""
        spec, common = self.spec, metadata.common
        if indices is None:
            if lse is None:
                return self.forward(q, k, None, kv_cache, metadata)
            key_pos = torch.arange(common.max_seq_len, device=q.device)
            indices = (
                key_pos[None, :].expand(q.shape[0], -1).masked_fill(key_pos[None, :] > metadata.token_pos[:, None], -1)
            )
        entries = kv_cache.view(-1, spec.head_size)  # [slots, head_size]
        entries.index_copy_(0, common.slot_mapping, k.reshape(-1, spec.head_size))
        bs, width = common.block_size, indices.shape[1]
        selected = indices >= 0  # [T, n]
        positions = indices.clamp(min=0)
        slots = common.block_tables[metadata.token_seq[:, None], positions // bs] * bs + positions % bs  # [T, n]
        out = q.new_empty(q.shape[0], spec.num_heads, spec.latent_size)
        chunk = max(1, SPARSE_GATHER_ELEMENTS // (max(width, 1) * (spec.head_size + spec.num_heads)))
        for start in range(0, q.shape[0], chunk):
            rows = slice(start, start + chunk)
            keys = entries[slots[rows]].float()  # [c, n, D]
            scores = torch.einsum("chd,cnd->chn", q[rows].float(), keys).mul_(spec.scale)
            scores.masked_fill_(~selected[rows, None, :], float("-inf"))
            row_lse = torch.logsumexp(scores, dim=-1)  # [c, H]; -inf for a row selecting nothing
            probs = torch.exp(scores - row_lse[..., None]).nan_to_num_(0.0)  # such a row: 0, not nan
            out[rows] = torch.einsum("chn,cnr->chr", probs, keys[..., : spec.latent_size]).to(out.dtype)
            if lse is not None:
                lse[rows] = row_lse
        return out

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: CpuMlaMetadata,
    ) -> torch.Tensor:
        """q: [T, H, head_size] absorbed queries; k: [T, 1, head_size] new entries; v: None.
        Returns [T, H, latent_size]."""
        spec = self.spec
        entries = kv_cache.view(-1, spec.head_size)  # [slots, head_size]
        entries.index_copy_(0, metadata.common.slot_mapping, k.reshape(-1, spec.head_size))
        if metadata.prefill is None:  # decode only: the rows are the sequences, in order
            return self._attend_decode(q.unsqueeze(1), entries, metadata.decode).contiguous()
        out = q.new_empty(q.shape[0], spec.num_heads, spec.latent_size)
        if metadata.decode is not None:
            out[metadata.decode.tokens] = self._attend_decode(
                q[metadata.decode.tokens].unsqueeze(1), entries, metadata.decode
            )
        group = metadata.prefill
        # queries: [n, H, D] -> padded [chunks, longest chunk, H, D]
        padded = q.new_zeros(group.key_slots.shape[0], group.max_query_len, spec.num_heads, spec.head_size)
        padded[group.seq, group.row] = q[group.tokens]
        keys = entries[group.key_slots].unsqueeze(1)  # [chunks, 1, L, D]
        result = F.scaled_dot_product_attention(
            padded.transpose(1, 2),
            keys,
            keys,
            attn_mask=group.mask,
            is_causal=group.mask is None,
            scale=spec.scale,
            enable_gqa=True,
        )  # [chunks, H, longest chunk, D]
        out[group.tokens] = result.transpose(1, 2)[group.seq, group.row, :, : spec.latent_size]
        return out

    def _attend_decode(self, q: torch.Tensor, entries: torch.Tensor, group: MlaGroup) -> torch.Tensor:
        """q: [B, 1, H, D], each sequence's heads as the rows of one query block -> [B, H, latent_size]."""
        keys = entries[group.key_slots].unsqueeze(1)  # [B, 1, L, D]
        result = F.scaled_dot_product_attention(q, keys, keys, attn_mask=group.mask, scale=self.spec.scale)
        return result[:, 0, :, : self.spec.latent_size]


def key_slots_of(common: CommonAttentionMetadata, seqs: torch.Tensor, max_seq_len: int) -> torch.Tensor:
    """[len(seqs), max_seq_len] cache slot of each key position of sequences ``seqs`` (positions
    past a sequence's end read padding blocks, masked out)."""
    bs = common.block_size
    key_pos = torch.arange(max_seq_len, device=seqs.device)
    return common.block_tables[seqs][:, key_pos // bs] * bs + key_pos % bs


def decode_group(
    common: CommonAttentionMetadata, seqs: torch.Tensor, tokens: torch.Tensor, max_seq_len: int
) -> MlaGroup:
    """The sequences ``seqs``, each with its single new token at batch row ``tokens``."""
    device = seqs.device
    key_pos = torch.arange(max_seq_len, device=device)
    mask = (key_pos[None, :] < common.seq_lens[seqs, None])[:, None, None, :]  # [B, 1, 1, L]: the heads share it
    n = tokens.shape[0]
    return MlaGroup(
        tokens,
        torch.arange(n, device=device),
        torch.zeros(n, dtype=torch.int64, device=device),
        key_slots_of(common, seqs, max_seq_len),
        mask,
        1,
    )


def prefill_group(common: CommonAttentionMetadata, seqs: torch.Tensor) -> MlaGroup:
    """The sequences ``seqs`` with several new tokens each, padded to the longest chunk."""
    device = seqs.device
    query_lens, context_lens = common.query_lens[seqs], common.context_lens[seqs]
    max_query_len, max_seq_len = common.max_query_len, int(common.seq_lens[seqs].max())
    seq = torch.repeat_interleave(torch.arange(seqs.shape[0], device=device), query_lens)  # [n]
    starts = common.query_start_loc[seqs]
    offsets = torch.zeros_like(query_lens)
    offsets[1:] = query_lens.cumsum(0)[:-1]
    row = torch.arange(seq.shape[0], device=device) - offsets[seq]
    tokens = starts[seq] + row
    # query row r of chunk b sits at position context_lens[b] + r (padding rows clamp to the
    # last real position so that no row is fully masked)
    key_slots = key_slots_of(common, seqs, max_seq_len)
    if seqs.shape[0] == 1 and int(context_lens[0]) == 0:
        return MlaGroup(tokens, seq, row, key_slots, None, max_query_len)
    rows = torch.arange(max_query_len, device=device)
    query_pos = torch.minimum(context_lens[:, None] + rows[None, :], context_lens[:, None] + query_lens[:, None] - 1)
    key_pos = torch.arange(max_seq_len, device=device)
    mask = (key_pos[None, None, :] <= query_pos[:, :, None]).unsqueeze(1)  # [b, 1, max_query_len, L]
    return MlaGroup(tokens, seq, row, key_slots, mask, max_query_len)
