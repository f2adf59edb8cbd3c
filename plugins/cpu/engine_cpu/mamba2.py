"""The Mamba-2 selective scan (kind ``mamba2``) on the CPU.

Each request owns a state slot: [slot, conv inputs (conv_kernel - 1) · channels + SSM state
heads · head_size · state_size], float32, flat. A step runs in two batched forms, no loop
over requests:

- **Decode** (every sequence one new token): the convolution over the kept inputs and the new
  one, and the recurrence one step, ``S ← exp(Δ A) S + Δ x Bᵀ``, ``y = S C + D x``, for all
  sequences at once: the native ``mamba2_decode``, in place on the slots (one pass over each
  state), or the core's ``engine.kernels.mamba2_torch.forward_decode`` without the kernels.
- **Chunks** (otherwise): the step's tokens padded to [sequences, chunks of :data:`CHUNK`];
  padding has ``Δ = 0``, so it leaves the state as it was. The chunked (SSD) form, laid out so
  that every product is one batched matmul over all sequences, chunks and heads, with no copy
  of its operands, and every other pass one sweep over memory:

  - the convolution over [kept inputs; new inputs], SiLU, rounded to the model's dtype, written
    per chunk head-major: x [seqs, chunks, H, l, P], B and C [seqs, chunks, G, l, N];
  - within a chunk, per group ``C Bᵀ``, then per head the causal decayed scores
    ``(C_i · B_j) exp(a_{j+1} + ... + a_i) Δ_j``, times x;
  - each chunk's own state ``Σ_j exp(a_{j+1} + ... + a_end) Δ_j x_j B_jᵀ``, one product per
    group with its heads side by side;
  - across chunks the state entering each one, ``S ← exp(a_1 + ... + a_end) S + own state``;
  - ``y_i += exp(a_1 + ... + a_i) S C_i`` (again a group's heads side by side) and ``D x``,
    gathered to the step's token rows.

  Everything after the convolution's rounding is float32, as the contract states it: matmuls
  on bf16 operands (which torch rounds to bf16 on output) missed its tolerances on long,
  slowly decaying sequences. The convolution, the scores, the pass across chunks and the
  gather are the native kernels' (``csrc/mamba2.cpp``) where engine-cpu's kernels load, torch
  ops otherwise; the matmuls are torch's.

Sequences with no cached tokens start from zeros, whatever their slot held before.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from engine.interfaces.attention import MAMBA2, AttentionCapabilities, AttentionSpec, Mamba2Backend
from engine.kernels.mamba2_torch import Mamba2Metadata, forward_decode, split_state, time_steps
from engine_cpu.kda import StateSlots

# tokens per chunk: the within-chunk work grows with it, the states passed between chunks
# shrink with it; 64 measured fastest for Nemotron-H's sizes (benchmarks/mamba2_bench.py)
CHUNK = 64
# decays below exp(LOG_DECAY_FLOOR) (~1e-26 of a term) count as 0: as denormals they would slow
# the float32 matmuls and sums that follow several times over, for nothing
LOG_DECAY_FLOOR = -60.0


class CpuMamba2(StateSlots, Mamba2Backend):
    name = "cpu_mamba2"
    capabilities = AttentionCapabilities(
        kinds=frozenset({MAMBA2}),
        platforms=frozenset({"cpu"}),
        dtypes=frozenset({"float32", "bfloat16"}),
    )

    def __init__(self, spec, block_size, dtype, device) -> None:
        super().__init__(spec, block_size, dtype, device)
        from engine_cpu import native

        self.kernels = native.load()

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
        if metadata.common.max_query_len > 1:
            return self.forward_chunks(xbc, conv_weight, conv_bias, dt, dt_bias, A, D, state, metadata)
        if self.kernels is None or xbc.dtype not in (torch.float32, torch.bfloat16) or not state.is_contiguous():
            return forward_decode(self.spec, xbc, conv_weight, conv_bias, dt, dt_bias, A, D, state, metadata)
        spec = self.spec
        out = torch.empty(xbc.shape[0], spec.num_heads, spec.head_size, device=xbc.device)
        self.kernels.mamba2_decode(
            out,
            xbc.contiguous(),
            state,
            metadata.common.state_slots.long().contiguous(),
            metadata.fresh.contiguous(),
            conv_weight.float().t().contiguous(),
            conv_bias.float().contiguous() if conv_bias is not None else out.new_empty(0),
            time_steps(spec, dt, dt_bias).contiguous(),
            A.float().contiguous(),
            D.float().contiguous(),
            spec.num_groups,
            spec.state_size,
        )
        return out

    def forward_chunks(self, xbc, conv_weight, conv_bias, dt, dt_bias, A, D, state, metadata: Mamba2Metadata):
        """The chunked form of any step: y [T, H, head_size] float32."""
        spec, common = self.spec, metadata.common
        kernels = self.kernels if xbc.dtype in (torch.float32, torch.bfloat16) else None
        rows = common.max_query_len
        length = min(CHUNK, rows)
        chunks = -(-rows // length)
        layout = ChunkLayout(spec, common.num_seqs, chunks, length)
        conv_states, ssm_states = split_state(spec, state)
        slots, fresh = common.state_slots, metadata.fresh
        kept = conv_states[slots].masked_fill(fresh[:, None, None], 0.0)  # [B, kernel - 1, C]
        initial = ssm_states[slots].masked_fill(fresh[:, None, None, None], 0.0)  # [B, H, P, N]
        starts, lens = common.query_start_loc.long().contiguous(), common.query_lens.long().contiguous()
        x, b, c = convolve(kernels, layout, xbc, kept, conv_weight, conv_bias, starts, lens)
        conv_states[slots] = last_inputs(xbc, kept, starts, lens)
        seq, row = metadata.token_seq.long().contiguous(), metadata.token_row.long().contiguous()
        delta = xbc.new_zeros(common.num_seqs, chunks * length, spec.num_heads, dtype=torch.float32)
        delta[seq, row] = time_steps(spec, dt, dt_bias)
        delta = delta.view(common.num_seqs, chunks, length, spec.num_heads).transpose(2, 3).contiguous()  # [B, c, H, l]
        y, entering, cumulative, final = scan_chunks(kernels, layout, x, b, c, delta, A, initial)
        ssm_states[slots] = final
        return gather_outputs(kernels, layout, y, entering, x, cumulative, D, seq, row)


class ChunkLayout:
    """The sizes of a chunked step: ``seqs`` sequences of ``chunks`` chunks of ``length`` rows."""

    def __init__(self, spec: AttentionSpec, seqs: int, chunks: int, length: int) -> None:
        self.seqs, self.chunks, self.length = seqs, chunks, length
        self.heads, self.head_size = spec.num_heads, spec.head_size
        self.groups, self.state_size = spec.num_groups, spec.state_size
        self.heads_per_group = spec.num_heads // spec.num_groups


def decay_of(log_decay: torch.Tensor) -> torch.Tensor:
    """exp(log_decay), 0 below :data:`LOG_DECAY_FLOOR`."""
    return log_decay.masked_fill(log_decay < LOG_DECAY_FLOOR, -math.inf).exp_()


def last_inputs(xbc, kept, query_start_loc, query_lens) -> torch.Tensor:
    """Each sequence's last ``kernel - 1`` inputs of [kept; new], float32 [B, kernel - 1, C]."""
    width = kept.shape[1]
    index = query_lens[:, None] + torch.arange(width, device=xbc.device)  # [B, width] in [kept; new]
    from_kept = kept.gather(1, index.clamp(max=width - 1)[..., None].expand_as(kept))
    from_new = xbc[(query_start_loc[:-1, None] + index - width).clamp(min=0)].float()
    return torch.where((index < width)[..., None], from_kept, from_new)


def convolve(kernels, layout: ChunkLayout, xbc, kept, conv_weight, conv_bias, query_start_loc, query_lens):
    """The causal depthwise convolution of each sequence's [kept; new] inputs, plus the bias,
    SiLU, rounded to xbc's dtype (padding rows: the convolution of zeros). Returns x [B, c, H,
    l, P], B and C [B, c, G, l, N], float32."""
    seqs, chunks, length = layout.seqs, layout.chunks, layout.length
    heads, groups = layout.heads, layout.groups
    if kernels is not None:
        x = xbc.new_empty(seqs, chunks, heads, length, layout.head_size, dtype=torch.float32)
        b = xbc.new_empty(seqs, chunks, groups, length, layout.state_size, dtype=torch.float32)
        c = torch.empty_like(b)
        weight = conv_weight.float().t().contiguous()  # [kernel, C]
        bias = conv_bias.float().contiguous() if conv_bias is not None else weight.new_empty(0)
        kernels.mamba2_conv(x, b, c, xbc.contiguous(), kept.contiguous(), weight, bias, query_start_loc, query_lens)
        return x, b, c
    width = kept.shape[1]
    rows = chunks * length
    padded = xbc.new_zeros(seqs, width + rows, xbc.shape[1], dtype=torch.float32)
    padded[:, :width] = kept
    seq = torch.repeat_interleave(torch.arange(seqs, device=xbc.device), query_lens, output_size=xbc.shape[0])
    token = torch.arange(xbc.shape[0], device=xbc.device)
    padded[seq, width + token - query_start_loc[seq]] = xbc.float()
    weight = conv_weight.float()
    convolved = padded[:, :rows] * weight[:, 0]
    for k in range(1, width + 1):
        convolved.addcmul_(padded[:, k : k + rows], weight[:, k])
    if conv_bias is not None:
        convolved += conv_bias.float()
    activated = F.silu(convolved).to(xbc.dtype).float()  # [B, rows, C]
    x, b, c = activated.split([heads * layout.head_size, groups * layout.state_size, groups * layout.state_size], -1)
    return (
        x.reshape(seqs, chunks, length, heads, -1).transpose(2, 3).contiguous(),
        b.reshape(seqs, chunks, length, groups, -1).transpose(2, 3).contiguous(),
        c.reshape(seqs, chunks, length, groups, -1).transpose(2, 3).contiguous(),
    )


def chunk_scores(kernels, layout: ChunkLayout, cb, cumulative, delta):
    """Per head the causal decayed scores [B, c, H, l, l], ``cb[g(h)]_ij exp(A_i - A_j) Δ_j`` for
    j <= i (``A`` the cumulative log decays), 0 above; float32. cb [B, c, G, l, l]."""
    seqs, chunks, length = layout.seqs, layout.chunks, layout.length
    if kernels is not None:
        scores = cb.new_empty(seqs, chunks, layout.heads, length, length)
        kernels.mamba2_chunk_scores(scores, cb, cumulative, delta, LOG_DECAY_FLOOR)
        return scores
    segments = cumulative[..., :, None] - cumulative[..., None, :]  # [B, c, H, l, l]
    causal = torch.ones(length, length, dtype=torch.bool, device=cb.device).tril()
    segments.masked_fill_(~causal | (segments < LOG_DECAY_FLOOR), -math.inf).exp_().mul_(delta[..., None, :])
    scores = segments.view(seqs, chunks, layout.groups, layout.heads_per_group, length, length)
    scores.mul_(cb[:, :, :, None])
    return scores.view(seqs, chunks, layout.heads, length, length)


def pass_states(kernels, states, decays, initial) -> torch.Tensor:
    """The states entering each chunk, in place of the chunks' own: ``S_0 = initial``, ``S_{k+1}
    = decays[k] S_k + states[k]``. states [B, c, H, P, N], decays [B, c, H], initial [B, H, P,
    N], float32. Returns S after the last chunk."""
    if kernels is not None:
        final = torch.empty_like(initial)
        kernels.mamba2_pass_states(states, decays, initial.contiguous(), final)
        return final
    carried = initial
    for k in range(states.shape[1]):
        own = states[:, k].clone()
        states[:, k] = carried
        carried = torch.addcmul(own, carried, decays[:, k, :, None, None])
    return carried


def scan_chunks(kernels, layout: ChunkLayout, x, b, c, delta, A, initial):
    """The SSD scan over chunks, float32. x [B, c, H, l, P], B and C [B, c, G, l, N]; Δ [B, c,
    H, l] (0 on padding); initial [B, H, P, N]. Returns the chunks' own outputs [B, c, H, l, P]
    and those of the states entering them before their decays, ``S C_i`` [B, c, G, l, H / G,
    P], the cumulative log decays [B, c, H, l] and the final state [B, H, P, N]."""
    seqs, chunks, length = layout.seqs, layout.chunks, layout.length
    heads, head_size, groups, state_size = layout.heads, layout.head_size, layout.groups, layout.state_size
    per_group = layout.heads_per_group
    cumulative = (delta * A.float()[:, None]).cumsum(-1)  # [B, c, H, l]: log decays from the chunk's start
    # within chunks: y_i = Σ_{j <= i} (C_i · B_j) exp(A_i - A_j) Δ_j x_j
    cb = torch.bmm(c.view(-1, length, state_size), b.view(-1, length, state_size).transpose(1, 2))
    scores = chunk_scores(kernels, layout, cb.view(seqs, chunks, groups, length, length), cumulative, delta)
    y = torch.bmm(scores.view(-1, length, length), x.view(-1, length, head_size))
    del cb, scores  # the largest of the step's tensors go as soon as they are used
    # each chunk's own state at its end, Σ_j exp(A_end - A_j) Δ_j x_j B_jᵀ: a group's heads side by side
    to_end = decay_of(cumulative[..., -1:] - cumulative).mul_(delta)  # [B, c, H, l]
    weighted = x.new_empty(seqs, chunks, groups, length, per_group, head_size)
    torch.mul(
        x.view(seqs, chunks, groups, per_group, length, head_size).permute(0, 1, 2, 4, 3, 5),
        to_end.view(seqs, chunks, groups, per_group, length, 1).permute(0, 1, 2, 4, 3, 5),
        out=weighted,
    )
    states = torch.bmm(weighted.view(-1, length, per_group * head_size).transpose(1, 2), b.view(-1, length, state_size))
    del weighted
    states = states.view(seqs, chunks, heads, head_size, state_size)
    final = pass_states(kernels, states, decay_of(cumulative[..., -1]).contiguous(), initial)
    # from the state entering the chunk: S C_i, per group (exp(A_i) applied when gathering)
    entering = torch.bmm(
        c.view(-1, length, state_size), states.view(-1, per_group * head_size, state_size).transpose(1, 2)
    )
    return (
        y.view(seqs, chunks, heads, length, head_size),
        entering.view(seqs, chunks, groups, length, per_group, head_size),
        cumulative,
        final,
    )


def gather_outputs(kernels, layout: ChunkLayout, y, entering, x, cumulative, D, token_seq, token_row):
    """The step's outputs [T, H, P] float32: ``y + exp(A_i) S C_i + D x`` at each token's
    (sequence, row)."""
    if kernels is not None:
        out = torch.empty(token_seq.shape[0], layout.heads, layout.head_size, device=y.device)
        kernels.mamba2_gather_outputs(
            out, y, entering, x, cumulative, D.float().contiguous(), token_seq, token_row, LOG_DECAY_FLOOR
        )
        return out
    seqs, chunks, length, heads = layout.seqs, layout.chunks, layout.length, layout.heads
    entering = entering.permute(0, 1, 2, 4, 3, 5).reshape(seqs, chunks, heads, length, layout.head_size)
    out = y.addcmul(entering, decay_of(cumulative)[..., None])
    out.addcmul_(x, D.float()[:, None, None])
    out = out.transpose(2, 3).reshape(seqs, chunks * length, heads, layout.head_size)
    return out[token_seq, token_row]
