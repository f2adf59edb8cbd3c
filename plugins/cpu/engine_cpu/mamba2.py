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

from engine.interfaces.attention import MAMBA2, AttentionCapabilities, Mamba2Backend
from engine.kernels.mamba2_torch import Mamba2Metadata, forward_chunked, forward_decode
from engine_cpu.kda import StateSlots


class CpuMamba2(StateSlots, Mamba2Backend):
    name = "cpu_mamba2"
    capabilities = AttentionCapabilities(
        kinds=frozenset({MAMBA2}),
        platforms=frozenset({"cpu"}),
        dtypes=frozenset({"float32", "bfloat16"}),
    )

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
