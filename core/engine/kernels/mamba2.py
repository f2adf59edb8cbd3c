"""The Mamba-2 selective scan in Triton, and ``triton_mamba2``, the ``mamba2`` backend that runs it
(for GPU platforms to list; checked on the CPU under ``TRITON_INTERPRET=1``).

Two kernels, one program per (sequence, head) each, the head's state ``S`` [head_size,
state_size] held in registers from the first token to the last and written back once:

- :func:`mamba2_recurrent` for decode steps: token by token, ``S ← exp(Δ A) S + Δ x Bᵀ``,
  ``y = S C + D x``.
- :func:`mamba2_chunked` for prefills: 16 rows at a time in the chunked (SSD) form, the rows of
  a chunk handled together by matrix products (see its kernel's docstring).

The short convolution and the time steps run before them in torch (``mamba2_torch.prepare``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.interfaces.attention import MAMBA2, AttentionCapabilities, Mamba2Backend
from engine.kernels.mamba2_torch import Mamba2Metadata, build_metadata, prepare, split_state


@triton.jit
def _program_head(A, D, lengths, heads, groups):
    """This program's sequence and head, the head's group of B and C, its A and D, and the
    sequence's length (both kernels start from them)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    return seq, head, head // (heads // groups), tl.load(A + head), tl.load(D + head), tl.load(lengths + seq)


@triton.jit
def _head_state(state, seq, head, head_size, state_size, state_stride, BP: tl.constexpr, BN: tl.constexpr):
    """The offsets over head_size and state_size with their masks, and the head's state: its
    pointers and mask (to store it back to at the end) and the [BP, BN] tile loaded from them."""
    offs_p = tl.arange(0, BP)
    offs_n = tl.arange(0, BN)
    mask_p = offs_p < head_size
    mask_n = offs_n < state_size
    mask_s = mask_p[:, None] & mask_n[None, :]
    s_ptr = state + seq * state_stride + head * head_size * state_size + offs_p[:, None] * state_size + offs_n[None, :]
    return offs_p, mask_p, offs_n, mask_n, s_ptr, mask_s, tl.load(s_ptr, mask=mask_s, other=0.0)


@triton.jit
def _mamba2_recurrent(
    x,
    delta,
    A,
    b,
    c,
    D,
    state,
    out,
    lengths,
    rows,
    heads,
    groups,
    head_size,
    state_size,
    state_stride,
    BP: tl.constexpr,
    BN: tl.constexpr,
):
    """x, out: [B, rows, H, P]; Δ [B, rows, H]; b, c [B, rows, G, N]; A, D [H] (contiguous,
    fp32); state [B, H, P, N] with ``state_stride`` between sequences; lengths [B]."""
    seq, head, group, a_h, d_h, length = _program_head(A, D, lengths, heads, groups)
    offs_p, mask_p, offs_n, mask_n, s_ptr, mask_s, s = _head_state(
        state, seq, head, head_size, state_size, state_stride, BP, BN
    )
    for t in range(0, length):
        token = seq * rows + t
        x_t = tl.load(x + (token * heads + head) * head_size + offs_p, mask=mask_p, other=0.0)
        dt_t = tl.load(delta + token * heads + head)
        b_t = tl.load(b + (token * groups + group) * state_size + offs_n, mask=mask_n, other=0.0)
        c_t = tl.load(c + (token * groups + group) * state_size + offs_n, mask=mask_n, other=0.0)
        s = s * tl.exp(dt_t * a_h) + (dt_t * x_t)[:, None] * b_t[None, :]
        y = tl.sum(s * c_t[None, :], axis=1) + d_h * x_t
        tl.store(out + (token * heads + head) * head_size + offs_p, y, mask=mask_p)
    tl.store(s_ptr, s, mask=mask_s)


@triton.jit
def _mamba2_chunked(
    x,
    delta,
    A,
    b,
    c,
    D,
    state,
    out,
    lengths,
    rows,
    heads,
    groups,
    head_size,
    state_size,
    state_stride,
    C: tl.constexpr,
    BP: tl.constexpr,
    BN: tl.constexpr,
):
    """The chunked (SSD) form, one program per (sequence, head), walking its rows ``C`` at a time.

    Within a chunk (cumulative log decays ``a = cumsum(Δ A)``), with ``S`` the state entering
    it: ``y = (C Bᵀ ∘ L) (Δ x) + (C ∘ e^a) Sᵀ + D x`` where ``L_ij = e^{a_i - a_j}`` for ``j <=
    i`` and 0 above, then ``S ← e^{a_last} S + (Δ x ∘ e^{a_last - a})ᵀ B``. Every exponent is a
    difference ``<= 0`` (or a cumulative sum ``<= 0``), so nothing overflows."""
    seq, head, group, a_h, d_h, length = _program_head(A, D, lengths, heads, groups)
    offs_p, mask_p, offs_n, mask_n, s_ptr, mask_s, s = _head_state(
        state, seq, head, head_size, state_size, state_stride, BP, BN
    )  # s: [BP, BN]
    t = tl.arange(0, C)
    causal = t[:, None] >= t[None, :]
    for start in range(0, length, C):
        token = seq * rows + start + t  # [C]
        valid = start + t < length
        mx = valid[:, None] & mask_p[None, :]
        mn = valid[:, None] & mask_n[None, :]
        x_c = tl.load(x + (token[:, None] * heads + head) * head_size + offs_p[None, :], mask=mx, other=0.0)
        dt_c = tl.load(delta + token * heads + head, mask=valid, other=0.0)  # [C]
        b_c = tl.load(b + (token[:, None] * groups + group) * state_size + offs_n[None, :], mask=mn, other=0.0)
        c_c = tl.load(c + (token[:, None] * groups + group) * state_size + offs_n[None, :], mask=mn, other=0.0)
        a = tl.cumsum(dt_c * a_h, axis=0)  # [C], <= 0 and falling
        decay = tl.exp(tl.where(causal, a[:, None] - a[None, :], float("-inf")))  # [C, C]
        xs = x_c * dt_c[:, None]  # [C, BP]
        scores = tl.dot(c_c, tl.trans(b_c), input_precision="ieee") * decay  # [C, C]
        y = tl.dot(scores, xs, input_precision="ieee")
        y += tl.dot(c_c * tl.exp(a)[:, None], tl.trans(s), input_precision="ieee")  # [C, BP]
        y += d_h * x_c
        tl.store(out + (token[:, None] * heads + head) * head_size + offs_p[None, :], y, mask=mx)
        last = tl.sum(tl.where(t == C - 1, a, 0.0), axis=0)
        s = s * tl.exp(last) + tl.dot(tl.trans(xs * tl.exp(last - a)[:, None]), b_c, input_precision="ieee")
    tl.store(s_ptr, s, mask=mask_s)


def _launch(kernel, x, delta, A, b, c, D, state, lengths, **meta) -> torch.Tensor:
    num_seqs, rows, heads, head_size = x.shape
    groups, state_size = b.shape[2], b.shape[3]
    x, delta, b, c = (t.float().contiguous() for t in (x, delta, b, c))
    A, D = A.float().contiguous(), D.float().contiguous()
    out = torch.zeros(num_seqs, rows, heads, head_size, dtype=torch.float32, device=x.device)
    work = state if state.is_contiguous() else state.contiguous()
    # tl.dot takes blocks of at least 16 a side
    kernel[(num_seqs, heads)](
        x,
        delta,
        A,
        b,
        c,
        D,
        work,
        out,
        lengths.contiguous(),
        rows,
        heads,
        groups,
        head_size,
        state_size,
        work.stride(0),
        BP=max(16, triton.next_power_of_2(head_size)),
        BN=max(16, triton.next_power_of_2(state_size)),
        **meta,
    )
    if work is not state:
        state.copy_(work)
    return out


def mamba2_recurrent(x, delta, A, b, c, D, state, lengths) -> torch.Tensor:
    """The scan over each sequence's first ``lengths[b]`` rows, from and into ``state`` [B, H, P,
    N] (float32, updated in place). x: [B, rows, H, P]; Δ: [B, rows, H]; b, c: [B, rows, G, N];
    A, D: [H]. Returns y [B, rows, H, P] (rows past a length are left zero)."""
    return _launch(_mamba2_recurrent, x, delta, A, b, c, D, state, lengths)


def mamba2_chunked(x, delta, A, b, c, D, state, lengths, chunk: int = 16) -> torch.Tensor:
    """:func:`mamba2_recurrent`'s result by the chunked form (``chunk`` rows at a time, at least
    16), for prefills; same arguments."""
    return _launch(_mamba2_chunked, x, delta, A, b, c, D, state, lengths, C=chunk)


class TritonMamba2(Mamba2Backend):
    """The Mamba-2 scan (``forward_mamba2``) with the Triton kernels: the recurrent one for decode
    steps, the chunked one otherwise."""

    name = "triton_mamba2"
    capabilities = AttentionCapabilities(
        kinds=frozenset({MAMBA2}),
        platforms=frozenset({"cuda", "rocm", "xpu"}),
        dtypes=frozenset({"float32", "bfloat16", "float16"}),
    )

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.spec.state_numel())  # one flat float32 state per slot, as cpu_mamba2

    def cache_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float32

    def build_metadata(self, common) -> Mamba2Metadata:
        return build_metadata(common)

    def forward_mamba2(self, xbc, conv_weight, conv_bias, dt, dt_bias, A, D, state, metadata: Mamba2Metadata):
        x, b, c, delta, initial = prepare(self.spec, xbc, conv_weight, conv_bias, dt, dt_bias, state, metadata)
        states = initial.contiguous()
        run = mamba2_recurrent if metadata.common.max_query_len == 1 else mamba2_chunked
        y = run(x, delta, A, b, c, D, states, metadata.common.query_lens)
        split_state(self.spec, state)[1][metadata.common.state_slots] = states
        return y[metadata.token_seq, metadata.token_row]
