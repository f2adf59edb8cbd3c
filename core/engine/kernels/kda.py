"""Kimi delta attention in Triton, and ``triton_kda``, the linear-attention backend that runs it
(for GPU platforms to list; checked on the CPU under ``TRITON_INTERPRET=1``).

Two kernels, one program per (sequence, head) each, the head's state ``S`` [head_size,
value_size] held in registers from the first token to the last and written back once:

- :func:`kda_recurrent` for decode steps: token by token, ``S ← diag(e^g) S``,
  ``S += k ((v - Sᵀk) β)ᵀ``, ``o = Sᵀ q``.
- :func:`kda_chunked` for prefills: 16 rows at a time in the chunked (WY) form, the rows of a
  chunk handled together (see its kernel's docstring).

The short convolution and the normalisation run before them in torch (``kda_torch.prepare``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.interfaces.attention import LINEAR, AttentionBackend, AttentionCapabilities
from engine.kernels.kda_torch import KdaMetadata, build_metadata, prepare, split_state


@triton.jit
def _kda_recurrent(
    q, k, v, g, beta, state, out, lengths, rows, heads, dk, dv, state_stride, BK: tl.constexpr, BV: tl.constexpr
):
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
        kv_base = token * heads + head
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


@triton.jit
def _kda_chunked(
    q,
    k,
    v,
    g,
    beta,
    state,
    out,
    lengths,
    rows,
    heads,
    dk,
    dv,
    state_stride,
    C: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    """The chunked form, one program per (sequence, head), walking its rows ``C`` at a time.

    Within a chunk (cumulative log decays ``c``): ``A_ij = β_i k_i·k_j e^{c_i - c_j}`` for
    ``j < i``, ``T = (I + A)⁻¹`` by forward substitution, ``u = T (β v)``, ``w = T (β k e^c)``;
    then ``v' = u - w S``, ``o = (q e^c) S + tril(q_i·k_j e^{c_i - c_j}) v'`` and
    ``S ← e^{c_last} S + (k e^{c_last - c})ᵀ v'``. The decays are taken per (i, j, channel) from
    the differences ``c_i - c_j <= 0``, never from ``e^{-c}``, so nothing overflows."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    t = tl.arange(0, C)
    offs_k = tl.arange(0, BK)
    offs_v = tl.arange(0, BV)
    mask_k = offs_k < dk
    mask_v = offs_v < dv
    s_ptr = state + seq * state_stride + head * dk * dv + offs_k[:, None] * dv + offs_v[None, :]
    s = tl.load(s_ptr, mask=mask_k[:, None] & mask_v[None, :], other=0.0)
    length = tl.load(lengths + seq)
    lower = t[:, None] > t[None, :]  # strictly below the diagonal
    causal = t[:, None] >= t[None, :]
    eye = tl.where(t[:, None] == t[None, :], 1.0, 0.0)
    for start in range(0, length, C):
        token = start + t
        valid = token < length
        base = (seq * rows + token) * heads + head  # [C]
        mk = valid[:, None] & mask_k[None, :]
        mv = valid[:, None] & mask_v[None, :]
        q_c = tl.load(q + base[:, None] * dk + offs_k[None, :], mask=mk, other=0.0)
        k_c = tl.load(k + base[:, None] * dk + offs_k[None, :], mask=mk, other=0.0)
        g_c = tl.load(g + base[:, None] * dk + offs_k[None, :], mask=mk, other=0.0)
        v_c = tl.load(v + base[:, None] * dv + offs_v[None, :], mask=mv, other=0.0)
        b_c = tl.load(beta + base, mask=valid, other=0.0)
        c = tl.cumsum(g_c, axis=0)  # [C, BK]
        # decay[i, j, d] = e^{c_i - c_j} for j <= i, 0 above the diagonal
        diff = c[:, None, :] - c[None, :, :]
        decay = tl.exp(tl.where(causal[:, :, None], diff, float("-inf")))
        kb = k_c * b_c[:, None]
        a = tl.where(lower, tl.sum(kb[:, None, :] * k_c[None, :, :] * decay, axis=2), 0.0)  # [C, C]
        # T = (I + A)^-1, row by row: T_i = e_i - Σ_{j<i} A_ij T_j
        tm = eye
        for i in tl.static_range(1, C):
            a_i = tl.sum(tl.where(t[:, None] == i, a, 0.0), axis=0)  # row i of A [C]
            row = tl.sum(tl.where(t[:, None] == i, eye, 0.0), axis=0) - tl.sum(a_i[:, None] * tm, axis=0)
            tm = tl.where(t[:, None] == i, row[None, :], tm)
        u = tl.sum(tm[:, :, None] * (v_c * b_c[:, None])[None, :, :], axis=1)  # [C, BV]
        w = tl.sum(tm[:, :, None] * (kb * tl.exp(c))[None, :, :], axis=1)  # [C, BK]
        new_values = u - tl.sum(w[:, :, None] * s[None, :, :], axis=1)  # [C, BV]
        within = tl.sum(q_c[:, None, :] * k_c[None, :, :] * decay, axis=2)  # [C, C], zero above
        o = tl.sum((q_c * tl.exp(c))[:, :, None] * s[None, :, :], axis=1) + tl.sum(
            within[:, :, None] * new_values[None, :, :], axis=1
        )
        tl.store(out + base[:, None] * dv + offs_v[None, :], o, mask=mv)
        last = tl.sum(tl.where(t[:, None] == C - 1, c, 0.0), axis=0)  # c of the chunk's last row [BK]
        s = s * tl.exp(last)[:, None] + tl.sum(
            (k_c * tl.exp(last[None, :] - c))[:, :, None] * new_values[:, None, :], axis=0
        )
    tl.store(s_ptr, s, mask=mask_k[:, None] & mask_v[None, :])


def kda_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    lengths: torch.Tensor,
    chunk: int = 16,
) -> torch.Tensor:
    """:func:`kda_recurrent`'s result by the chunked form (``chunk`` rows at a time), for
    prefills; same arguments. Rows past a sequence's length must hold k = β = g = 0 (as
    ``kda_torch.prepare`` pads them) or lie past ``rows``."""
    num_seqs, rows, heads, dk = k.shape
    dv = v.shape[-1]
    q, k, v, g, beta = (x.float().contiguous() for x in (q, k, v, g, beta))
    out = torch.zeros(num_seqs, rows, heads, dv, dtype=torch.float32, device=q.device)
    work = state if state.is_contiguous() else state.contiguous()
    _kda_chunked[(num_seqs, heads)](
        q,
        k,
        v,
        g,
        beta,
        work,
        out,
        lengths.contiguous(),
        rows,
        heads,
        dk,
        dv,
        work.stride(0),
        C=chunk,
        BK=triton.next_power_of_2(dk),
        BV=triton.next_power_of_2(dv),
    )
    if work is not state:
        state.copy_(work)
    return out


def kda_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    lengths: torch.Tensor,
) -> torch.Tensor:
    """The gated delta rule over each sequence's first ``lengths[b]`` rows, from and into
    ``state`` [B, H, dk, dv] (float32, updated in place). q, k, g: [B, rows, H, dk]; v: [B, rows,
    H, dv]; beta: [B, rows, H]. Returns o [B, rows, H, dv] (rows past a length are left zero)."""
    num_seqs, rows, heads, dk = k.shape
    dv = v.shape[-1]
    q, k, v, g, beta = (x.float().contiguous() for x in (q, k, v, g, beta))
    out = torch.zeros(num_seqs, rows, heads, dv, dtype=torch.float32, device=q.device)
    work = state if state.is_contiguous() else state.contiguous()
    _kda_recurrent[(num_seqs, heads)](
        q,
        k,
        v,
        g,
        beta,
        work,
        out,
        lengths.contiguous(),
        rows,
        heads,
        dk,
        dv,
        work.stride(0),
        BK=triton.next_power_of_2(dk),
        BV=triton.next_power_of_2(dv),
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
        states = initial.contiguous()
        run = kda_recurrent if metadata.common.max_query_len == 1 else kda_chunked
        out = run(q, k, v, decay, strength, states, metadata.common.query_lens)
        split_state(self.spec, state)[1][metadata.common.state_slots] = states
        return out[metadata.token_seq, metadata.token_row].to(mixed_qkv.dtype)
