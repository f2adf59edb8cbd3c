"""The contract of the Mamba-2 mixer's selective scan (kind ``mamba2``, state space duality):
no per-token cache, one fixed-size state per running request."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch

from engine.interfaces.attention.backend import AttentionBackend


class Mamba2Backend(AttentionBackend):
    """A backend of kind ``mamba2``: ``kv_cache_shape(num_slots)`` holds one state per request
    slot (the last ``conv_kernel - 1`` convolution inputs [conv_kernel - 1, conv_channels], then
    the SSM state [num_heads, head_size, state_size], ``spec.state_numel()`` elements flat),
    usually in float32 (:meth:`cache_dtype`)."""

    @abstractmethod
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
        """The Mamba-2 selective scan over the step's tokens, continuing each sequence's state.

        xbc: [T, conv_channels], the projections of x ([num_heads, head_size]), B and C
        ([num_groups, state_size] each), side by side in that order, before the short
        convolution; conv_weight: [conv_channels, conv_kernel]; conv_bias: [conv_channels] or
        None; dt: [T, num_heads], the time steps before their bias; dt_bias, A (negative:
        ``-exp(A_log)``) and D: [num_heads]. ``state`` holds every slot's state (the backend's
        ``kv_cache_shape(num_slots)``); sequence ``b`` uses slot ``metadata.state_slots[b]``
        and starts from zeros when it has no cached tokens (``context_lens[b] == 0``),
        whatever the slot held.

        Per sequence: a causal depthwise convolution over its inputs (the last ``conv_kernel
        - 1`` kept from earlier steps) plus ``conv_bias``, SiLU, rounded to xbc's dtype, split
        into x, B and C; head ``h`` reads group ``h // (num_heads / num_groups)`` of B and C.
        Then per token, in float32, with ``Δ = clamp(softplus(dt + dt_bias), *spec.dt_limit)``
        per head: ``S = exp(Δ · A) · S + Δ · x Bᵀ`` ([head_size, state_size] per head) and
        ``y = S C + D · x``.
        Returns y [T, num_heads, head_size] in float32 (the model's gated norm follows);
        mutates ``state`` only (the convolution inputs and S after each sequence's last token).
        """

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: None, kv_cache: torch.Tensor, metadata: Any) -> torch.Tensor:
        """The Mamba-2 scan runs through :meth:`forward_mamba2`."""
        raise NotImplementedError(f"{self.name} serves the Mamba-2 scan through forward_mamba2")
