"""Kimi delta attention (kind ``linear``) on the CPU, in torch.

Each request owns a state slot: [slot, conv inputs (conv_kernel - 1) · channels + recurrent
matrix heads · head_size · value_size], float32, flat. A step runs in two batched forms, no
loop over requests:

- **Decode** (every sequence one new token): the convolution is one product with the kept
  inputs, and the recurrence one step, ``S ← diag(e^g) S``, ``S += β k (v - Sᵀk)ᵀ``,
  ``o = Sᵀ q``, for all sequences at once.
- **Chunks** (otherwise): the step's tokens padded to [sequences, longest chunk]; padding
  has ``k = 0``, ``β = 0`` and ``g = 0``, so it leaves the state as it was. The
  convolution runs over [kept inputs; new inputs]; the recurrence in the chunked form
  (chunks of 64): within a chunk the delta rule's WY representation (a unit lower
  triangular solve), across chunks the state carried in a loop.

Sequences with no cached tokens start from zeros, whatever their slot held before. The
forms are the core's (``engine.kernels.kda_torch``), which the Triton kernels are checked
against.
"""

from __future__ import annotations

import torch

from engine.interfaces.attention import (
    LINEAR,
    AttentionBackend,
    AttentionCapabilities,
    CommonAttentionMetadata,
)
from engine.kernels.kda_torch import KdaMetadata, build_metadata, chunked, prepare, recurrent_step, split_state


class CpuKdaAttention(AttentionBackend):
    name = "cpu_kda"
    capabilities = AttentionCapabilities(
        kinds=frozenset({LINEAR}),
        platforms=frozenset({"cpu"}),
        dtypes=frozenset({"float32", "bfloat16"}),
    )

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        # one flat float32 state per slot
        return (num_blocks, self.spec.state_numel())

    def cache_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float32

    def build_metadata(self, common: CommonAttentionMetadata) -> KdaMetadata:
        return build_metadata(common)

    def forward(self, q, k, v, kv_cache, metadata):
        """Linear attention runs through :meth:`forward_linear`."""
        raise NotImplementedError(f"{self.name} serves linear attention through forward_linear")

    def forward_linear(
        self,
        mixed_qkv: torch.Tensor,
        conv_weight: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
        metadata: KdaMetadata,
    ) -> torch.Tensor:
        q, k, v, decay, strength, initial = prepare(self.spec, mixed_qkv, conv_weight, g, beta, state, metadata)
        if metadata.common.max_query_len == 1:
            out, final = recurrent_step(q[:, 0], k[:, 0], v[:, 0], decay[:, 0], strength[:, 0], initial)
            out = out.unsqueeze(1)
        else:
            out, final = chunked(q, k, v, decay, strength, initial)
        split_state(self.spec, state)[1][metadata.common.state_slots] = final
        return out[metadata.token_seq, metadata.token_row].to(mixed_qkv.dtype)  # [T, H, dv]
