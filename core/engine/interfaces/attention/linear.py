"""The contract of linear attention, Kimi delta attention (kind ``linear``): no per-token cache,
one fixed-size state per running request."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch

from engine.interfaces.attention.backend import AttentionBackend


class LinearAttentionBackend(AttentionBackend):
    """A backend of kind ``linear``: ``kv_cache_shape(num_slots)`` holds one state per request
    slot (the last ``conv_kernel - 1`` convolution inputs and the recurrent matrix,
    ``spec.state_numel()`` elements), usually in float32 (:meth:`cache_dtype`)."""

    @abstractmethod
    def forward_linear(
        self,
        mixed_qkv: torch.Tensor,
        conv_weight: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
        metadata: Any,
    ) -> torch.Tensor:
        """Kimi delta attention over the step's tokens, continuing each sequence's state.

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

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: None, kv_cache: torch.Tensor, metadata: Any) -> torch.Tensor:
        """Linear attention runs through :meth:`forward_linear`."""
        raise NotImplementedError(f"{self.name} serves linear attention through forward_linear")
