"""The Mamba-2 selective scan (kind ``mamba2``) on the CPU, in torch.

Each request owns a state slot: [slot, conv inputs (conv_kernel - 1) · channels + SSM state
heads · head_size · state_size], float32, flat. A step runs in two batched forms, no loop
over requests:

- **Decode** (every sequence one new token): the convolution is one product with the kept
  inputs, and the recurrence one step, ``S ← exp(Δ A) S + Δ x Bᵀ``, ``y = S C + D x``, for all
  sequences at once.
- **Chunks** (otherwise): the step's tokens padded to [sequences, longest chunk]; padding has
  ``Δ = 0``, so it leaves the state as it was. The convolution runs over [kept inputs; new
  inputs]; the scan in the chunked (SSD) form, chunks of 64.

Sequences with no cached tokens start from zeros, whatever their slot held before. The forms
are the core's (``engine.kernels.mamba2_torch``), which the Triton kernels are checked against.
"""

from __future__ import annotations

import torch

from engine.interfaces.attention import MAMBA2, AttentionCapabilities, CommonAttentionMetadata, Mamba2Backend
from engine.kernels.mamba2_torch import Mamba2Metadata, build_metadata, forward_chunked, forward_decode


class CpuMamba2(Mamba2Backend):
    name = "cpu_mamba2"
    capabilities = AttentionCapabilities(
        kinds=frozenset({MAMBA2}),
        platforms=frozenset({"cpu"}),
        dtypes=frozenset({"float32", "bfloat16"}),
    )

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        # one flat float32 state per slot
        return (num_blocks, self.spec.state_numel())

    def cache_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float32

    def build_metadata(self, common: CommonAttentionMetadata) -> Mamba2Metadata:
        return build_metadata(common)

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
        metadata: Mamba2Metadata,
    ) -> torch.Tensor:
        form = forward_decode if metadata.common.max_query_len == 1 else forward_chunked
        return form(self.spec, xbc, conv_weight, conv_bias, dt, dt_bias, A, D, state, metadata)
