"""What a model's forward pass receives besides token ids and positions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.interfaces.attention import AttentionBackend
from engine.interfaces.ops import REFERENCE_OPS, LayerOps


@dataclass
class ForwardContext:
    """Per-step attention state, indexed by the model's attention ``layer_index``.

    ``backends[i]``, ``kv_caches[i]`` and ``metadata[i]`` belong to layer ``i``;
    layers of one KV-cache group share the backend and metadata objects.
    ``ops`` are the platform's elementwise layer operations.
    """

    backends: list[AttentionBackend]
    kv_caches: list[torch.Tensor]
    metadata: list[Any]
    ops: LayerOps = REFERENCE_OPS
    # the rows of the step whose final hidden states are read after the forward (int64,
    # ascending), when that is fewer than all of them: a step of prompt tokens where sampling
    # alone reads them. A model may then return those rows alone, in that order (DecoderStack
    # runs its last layer's MLP on them only); None: every row is read.
    output_rows: torch.Tensor | None = None

    def attention(
        self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Paged attention of layer ``layer_index``; ``sinks`` [num_heads] float32 for a layer whose
        spec sets ``sinks`` (see ``PagedAttentionBackend.forward``)."""
        backend, kv_cache, metadata = (
            self.backends[layer_index],
            self.kv_caches[layer_index],
            self.metadata[layer_index],
        )
        if sinks is None:
            return backend.forward(q, k, v, kv_cache, metadata)
        return backend.forward(q, k, v, kv_cache, metadata, sinks=sinks)

    def sparse_attention(
        self,
        layer_index: int,
        q: torch.Tensor,
        k: torch.Tensor,
        indices: torch.Tensor | None,
        lse: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Sparse MLA over the positions ``indices`` selects (see ``AttentionBackend.forward_sparse``)."""
        return self.backends[layer_index].forward_sparse(
            q, k, self.kv_caches[layer_index], self.metadata[layer_index], indices, lse
        )

    def index(self, layer_index: int, q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor) -> torch.Tensor | None:
        """An indexer's top-k positions for each query (see ``AttentionBackend.forward_index``)."""
        return self.backends[layer_index].forward_index(
            q, k, weights, self.kv_caches[layer_index], self.metadata[layer_index]
        )

    def linear(
        self, layer_index: int, mixed_qkv: torch.Tensor, conv_weight: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
    ) -> torch.Tensor:
        """Kimi delta attention continuing each request's state (see ``AttentionBackend.forward_linear``)."""
        return self.backends[layer_index].forward_linear(
            mixed_qkv, conv_weight, g, beta, self.kv_caches[layer_index], self.metadata[layer_index]
        )

    def mamba2(
        self,
        layer_index: int,
        xbc: torch.Tensor,
        conv_weight: torch.Tensor,
        conv_bias: torch.Tensor | None,
        dt: torch.Tensor,
        dt_bias: torch.Tensor,
        A: torch.Tensor,
        D: torch.Tensor,
    ) -> torch.Tensor:
        """The Mamba-2 selective scan continuing each request's state (see
        ``AttentionBackend.forward_mamba2``)."""
        return self.backends[layer_index].forward_mamba2(
            xbc, conv_weight, conv_bias, dt, dt_bias, A, D, self.kv_caches[layer_index], self.metadata[layer_index]
        )

    def store(self, layer_index: int, values: torch.Tensor) -> None:
        """Write each new token's values [T, head_size] into token-state layer ``layer_index``
        (see ``engine.runtime.token_state.TokenStateCache``)."""
        self.backends[layer_index].store(values, self.kv_caches[layer_index], self.metadata[layer_index])

    def gather(self, layer_index: int, positions: torch.Tensor) -> torch.Tensor:
        """[T, m, head_size]: token-state layer ``layer_index``'s values at ``positions`` [T, m] of
        each new token's own sequence (zeros where a position is -1)."""
        return self.backends[layer_index].gather(self.kv_caches[layer_index], self.metadata[layer_index], positions)
