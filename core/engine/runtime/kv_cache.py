"""KV-cache tensors: one group per distinct attention spec, one tensor per layer."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from engine.interfaces.attention import AttentionBackend, AttentionSpec, CommonAttentionMetadata
from engine.interfaces.forward_context import ForwardContext
from engine.interfaces.ops import REFERENCE_OPS, LayerOps

logger = logging.getLogger("engine")


@dataclass
class KVCacheGroup:
    spec: AttentionSpec
    backend: AttentionBackend
    layer_indices: list[int]


class KVCache:
    """The paged caches of every attention layer, sharing one block numbering."""

    def __init__(
        self,
        groups: list[KVCacheGroup],
        num_layers: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        ops: LayerOps = REFERENCE_OPS,
        allocate: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
        num_state_slots: int = 0,
        spare_blocks: int = 0,
        num_state_snapshots: int = 0,
    ) -> None:
        """Recurrent groups (linear attention) get ``num_state_slots`` request states each, then
        ``num_state_snapshots`` rows for prefix caching's copies of them, in their backend's
        cache dtype; the others ``num_blocks`` paged blocks, plus
        ``spare_blocks`` past them that no request is given (``spare_block_ids``: where the
        padding rows of a captured decode graph write)."""
        self.groups = groups
        self.ops = ops
        self.num_blocks = num_blocks
        self.spare_block_ids = list(range(num_blocks, num_blocks + spare_blocks))
        self.num_state_slots = num_state_slots
        self.num_state_snapshots = num_state_snapshots
        self.block_size = block_size
        self.layer_caches: list[torch.Tensor] = [torch.empty(0)] * num_layers
        self.layer_backends: list[AttentionBackend] = [None] * num_layers  # type: ignore[list-item]
        self.layer_group: list[int] = [0] * num_layers
        for g, group in enumerate(groups):
            shape = group.backend.kv_cache_shape(
                num_state_slots + num_state_snapshots if group.spec.is_recurrent else num_blocks + spare_blocks
            )
            cache_dtype = group.backend.cache_dtype(dtype)
            for layer in group.layer_indices:
                self.layer_caches[layer] = (
                    allocate(shape, cache_dtype)
                    if allocate is not None
                    else torch.zeros(shape, dtype=cache_dtype, device=device)
                )
                self.layer_backends[layer] = group.backend
                self.layer_group[layer] = g

    def forward_context(self, common: CommonAttentionMetadata) -> ForwardContext:
        per_group = [group.backend.build_metadata(common) for group in self.groups]
        return ForwardContext(
            backends=self.layer_backends,
            kv_caches=self.layer_caches,
            metadata=[per_group[g] for g in self.layer_group],
            ops=self.ops,
        )


def group_layers(specs: list[AttentionSpec]) -> list[tuple[AttentionSpec, list[int]]]:
    """Layers with equal specs form one group, in order of first appearance."""
    groups: dict[AttentionSpec, list[int]] = {}
    for index, spec in enumerate(specs):
        groups.setdefault(spec, []).append(index)
    return list(groups.items())


def num_blocks_for(
    specs: list[AttentionSpec], block_size: int, element_size: int, memory_bytes: int, max_blocks_useful: int
) -> int:
    bytes_per_block = block_size * sum(spec.kv_bytes_per_token(element_size) for spec in specs)
    if bytes_per_block == 0:  # only recurrent layers: blocks just count tokens
        return int(max_blocks_useful)
    num_blocks = min(memory_bytes // bytes_per_block, max_blocks_useful)
    if num_blocks < 1:
        raise ValueError(
            f"KV-cache memory of {memory_bytes / 2**30:.3f} GiB is too small for one block "
            f"({bytes_per_block} bytes); raise --kv-cache-memory."
        )
    return int(num_blocks)
