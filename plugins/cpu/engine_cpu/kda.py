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
import torch.nn.functional as F

from engine.interfaces.attention import (
    LINEAR,
    AttentionBackend,
    AttentionCapabilities,
    AttentionSpec,
    CommonAttentionMetadata,
)
from engine.kernels.kda_torch import (
    KdaMetadata,
    StateMetadata,
    build_metadata,
    chunked,
    l2_normalize,
    prepare,
    recurrent_step,
    split_state,
)


class StateSlots:
    """The cache and step metadata of a backend that keeps one flat float32 state per request
    slot (this one and ``cpu_mamba2``)."""

    spec: AttentionSpec

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.spec.state_numel())

    def cache_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float32

    def build_metadata(self, common: CommonAttentionMetadata) -> StateMetadata:
        return build_metadata(common)


class CpuKdaAttention(StateSlots, AttentionBackend):
    name = "cpu_kda"
    capabilities = AttentionCapabilities(
        kinds=frozenset({LINEAR}),
        platforms=frozenset({"cpu"}),
        dtypes=frozenset({"float32", "bfloat16"}),
    )

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
        if metadata.common.max_query_len == 1:
            return self._decode(mixed_qkv, conv_weight, g, beta, state, metadata)
        q, k, v, decay, strength, initial = prepare(self.spec, mixed_qkv, conv_weight, g, beta, state, metadata)
        out, final = chunked(q, k, v, decay, strength, initial)
        split_state(self.spec, state)[1][metadata.common.state_slots] = final
        return out[metadata.token_seq, metadata.token_row].to(mixed_qkv.dtype)  # [T, H, dv]

    def _decode(self, mixed_qkv, conv_weight, g, beta, state, metadata: KdaMetadata) -> torch.Tensor:
        """One token a sequence, token t of sequence t: no padding, no scatter of rows. The
        convolution is one product over [kept inputs; the new one], then one recurrence step."""
        spec = self.spec
        heads, dk, dv = spec.num_heads, spec.head_size, spec.value_size
        slots, fresh = metadata.common.state_slots, metadata.fresh
        conv_states, recurrent_states = split_state(spec, state)
        window = torch.cat([conv_states[slots], mixed_qkv.float()[:, None]], dim=1)  # [B, kernel, C]
        initial = recurrent_states[slots]
        if bool(fresh.any()):
            window[:, :-1].masked_fill_(fresh[:, None, None], 0.0)
            initial.masked_fill_(fresh[:, None, None, None], 0.0)
        conv_states[slots] = window[:, 1:]
        activated = F.silu(torch.einsum("bkc,ck->bc", window, conv_weight.float()))  # [B, C]
        q, k, v = activated.split([heads * dk, heads * dk, heads * dv], dim=-1)
        num_seqs = activated.shape[0]
        q = l2_normalize(q.view(num_seqs, heads, dk)) * spec.scale
        k = l2_normalize(k.view(num_seqs, heads, dk))
        out, final = recurrent_step(q, k, v.reshape(num_seqs, heads, dv), g.float(), beta.float(), initial)
        recurrent_states[slots] = final
        return out.to(mixed_qkv.dtype)  # [B, H, dv]
