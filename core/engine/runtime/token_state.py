"""Per-token values a model stores and reads back itself (cache kind ``token_state``).

Some models keep per-token state that is not attended to but read back later by
position: DeepSeek-V4's compressors pool the projections of every ``ratio``
tokens into one compressed entry once the last token of the window arrives, which
may be several steps (and chunks) after the first. Held in the paged cache, one
``head_size`` vector per token in the shared block numbering, such state follows
requests through chunked prefill, preemption and prefix caching like keys do.

The core serves this kind on every platform (plain tensor indexing); platforms
list no backend for it. It implements engine.interfaces.attention.TokenStateBackend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from engine.interfaces.attention import (
    TOKEN_STATE,
    AttentionCapabilities,
    AttentionSpec,
    CommonAttentionMetadata,
    TokenStateBackend,
)


@dataclass
class TokenStateMetadata:
    common: CommonAttentionMetadata
    token_seq: torch.Tensor  # [T] the sequence of each new token


class TokenStateCache(TokenStateBackend):
    """``store`` writes the step's new tokens' values; ``gather`` reads any positions of each
    new token's sequence. Cache layout [block, offset in block, head_size]."""

    name = "token_state"
    capabilities: ClassVar[AttentionCapabilities] = AttentionCapabilities(
        kinds=frozenset({TOKEN_STATE}),
        platforms=frozenset(),
        dtypes=frozenset(),
    )

    @classmethod
    def validate(
        cls, spec: AttentionSpec, *, platform: str, dtype: str, block_size: int, kv_cache_dtype: str = "auto"
    ) -> list[str]:
        """Any platform, dtype and block size: only the kind must be ``token_state``."""
        return (
            [] if spec.kind == TOKEN_STATE else [f"attention kind {spec.kind!r} not supported (supports token_state)"]
        )

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.block_size, self.spec.head_size)

    def gather_kv(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values = kv_cache.view(-1, 1, self.spec.head_size)[slots]
        return values, values.new_empty(values.shape[0], 0, self.spec.head_size)

    def scatter_kv(self, kv_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> None:
        kv_cache.view(-1, 1, self.spec.head_size)[slots] = k

    def build_metadata(self, common: CommonAttentionMetadata) -> TokenStateMetadata:
        return TokenStateMetadata(common, common.token_seq)

    def store(self, values: torch.Tensor, kv_cache: torch.Tensor, metadata: TokenStateMetadata) -> None:
        kv_cache.view(-1, self.spec.head_size).index_copy_(
            0, metadata.common.slot_mapping, values.reshape(-1, self.spec.head_size).to(kv_cache.dtype)
        )

    def gather(self, kv_cache: torch.Tensor, metadata: TokenStateMetadata, positions: torch.Tensor) -> torch.Tensor:
        common, bs = metadata.common, metadata.common.block_size
        valid = positions >= 0
        clamped = positions.clamp(min=0)
        slots = common.block_tables[metadata.token_seq[:, None], clamped // bs] * bs + clamped % bs
        values = kv_cache.view(-1, self.spec.head_size)[slots]
        return values.masked_fill_(~valid[..., None], 0)
