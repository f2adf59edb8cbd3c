"""Kimi delta attention in Triton, and ``triton_kda``, the linear-attention backend that runs it
(for GPU platforms to list; checked on the CPU under ``TRITON_INTERPRET=1``).

The kernel is the fused recurrent form: one program per (sequence, head) keeps the head's
state ``S`` [head_size, value_size] in registers and walks the sequence's new tokens in order,
``S ← diag(e^g) S``, ``S += k ((v - Sᵀk) β)ᵀ``, ``o = Sᵀ q``, reading each token once and
writing the state back once. It serves decode steps and prefill chunks alike; the short
convolution and the normalisation run before it in torch (``kda_torch.prepare``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.interfaces.attention import LINEAR, AttentionBackend, AttentionCapabilities
from engine.kernels.kda_torch import KdaMetadata, build_metadata, prepare, split_state


@triton.jit
def _kda_recurrent(q, k, v, g, beta, state, out, lengths, rows, heads,
                   dk, dv, state_stride, BK: tl.constexpr, BV: tl.constexpr):
    """q, k, g: [B, rows, H, dk]; v, out: [B, rows, H, dv]; beta [B, rows, H] (contiguous, fp32);
    state: [B, H, dk, dv] with ``state_stride`` between sequences; lengths [B]."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_k = tl.arange(0, BK)
    offs_v = tl.arange(0, BV)
    mask_k = offs_k < dk
    mask_v = offs_v < dv
    mask_s = mask_k[:, None] & mask_v[None, :]
    s_ptr = state + seq * state_stride + head * dk * dv + offs_k[:, None] * dv + offs_v[None, :]
    s = tl.load(s_ptr, mask=mask_s, other=0.0)
    length = tl.load(lengths + seq)
    for t in range(0, length):
        token = seq * rows + t
        kv_base = (token * heads + head)
        q_t = tl.load(q + kv_base * dk + offs_k, mask=mask_k, other=0.0)
        k_t = tl.load(k + kv_base * dk + offs_k, mask=mask_k, other=0.0)
        g_t = tl.load(g + kv_base * dk + offs_k, mask=mask_k, other=0.0)
        v_t = tl.load(v + kv_base * dv + offs_v, mask=mask_v, other=0.0)
        b_t = tl.load(beta + kv_base)
        s = s * tl.exp(g_t)[:, None]
        remembered = tl.sum(s * k_t[:, None], axis=0)  # Sᵀk [dv]
        s = s + k_t[:, None] * ((v_t - remembered) * b_t)[None, :]
        tl.store(out + kv_base * dv + offs_v, tl.sum(s * q_t[:, None], axis=0), mask=mask_v)
    tl.store(s_ptr, s, mask=mask_s)


def kda_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The gated delta rule over each sequence's first ``lengths[b]`` rows, from and into
    ``state`` [B, H, dk, dv] (float32, updated in place). q, k, g: [B, rows, H, dk]; v: [B, rows,
    H, dv]; beta: [B, rows, H]. Returns o [B, rows, H, dv] (rows past a length are left zero)."""
    num_seqs, rows, heads, dk = k.shape
    dv = v.shape[-1]
    q, k, v, g, beta = (x.float().contiguous() for x in (q, k, v, g, beta))
    out = torch.zeros(num_seqs, rows, heads, dv, dtype=torch.float32, device=q.device)
    work = state if state.is_contiguous() else state.contiguous()
    _kda_recurrent[(num_seqs, heads)](
        q, k, v, g, beta, work, out, lengths.contiguous(), rows, heads, dk, dv, work.stride(0),
        BK=triton.next_power_of_2(dk), BV=triton.next_power_of_2(dv),
    )
    if work is not state:
        state.copy_(work)
    return out


class TritonKdaAttention(AttentionBackend):
    """Linear attention (``forward_linear``) with the fused recurrent Triton kernel."""

    name = "triton_kda"
    capabilities = AttentionCapabilities(
        kinds=frozenset({LINEAR}),
        platforms=frozenset({"cuda", "rocm", "xpu"}),
        dtypes=frozenset({"float32", "bfloat16", "float16"}),
    )

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.spec.state_numel())  # one flat float32 state per slot, as cpu_kda

    def cache_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float32

    def build_metadata(self, common) -> KdaMetadata:
        return build_metadata(common)

    def forward(self, q, k, v, kv_cache, metadata):
        """Linear attention runs through :meth:`forward_linear`."""
        raise NotImplementedError(f"{self.name} serves linear attention through forward_linear")

    def forward_linear(self, mixed_qkv: torch.Tensor, conv_weight: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor, state: torch.Tensor, metadata: KdaMetadata) -> torch.Tensor:
        q, k, v, decay, strength, initial = prepare(self.spec, mixed_qkv, conv_weight, g, beta, state, metadata)
        states = initial.contiguous()
        out = kda_recurrent(q, k, v, decay, strength, states, metadata.common.query_lens)
        split_state(self.spec, state)[1][metadata.common.state_slots] = states
        return out[metadata.token_seq, metadata.token_row].to(mixed_qkv.dtype)

