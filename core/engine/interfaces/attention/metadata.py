"""The per-step batch every attention backend receives (:class:`CommonAttentionMetadata`)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


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
    - ``state_slots``: [B] each sequence's recurrent-state slot (models with recurrent layers,
      linear attention or Mamba-2; None otherwise)

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
