"""The Mamba-2 selective scan in torch (state space duality): the forms the engine's Mamba-2
backends share and the Triton kernels are checked against.

- :func:`prepare` runs the short convolution for a step's sequences padded to [sequences,
  rows] (the inputs kept from earlier steps first), keeps each sequence's last ``kernel - 1``
  inputs, and returns x, B, C and the time steps Δ, padded; padding rows have ``Δ = 0``, so
  they leave a state unchanged (decay ``exp(0) = 1``, no input).
- :func:`recurrent_step` is one token per sequence; :func:`chunked` the chunked form (the
  Mamba-2 paper's SSD: within chunks of 64 a masked, decayed ``C Bᵀ`` product, across chunks
  the states passed on by one product with the chunks' decays).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.interfaces.attention import AttentionSpec
from engine.kernels import kda_torch
from engine.kernels.kda_torch import StateMetadata
from engine.kernels.kda_torch import build_metadata as build_metadata

CHUNK = 64

# a step's metadata, and how it is built, are KDA's: both kinds keep a state per request
Mamba2Metadata = StateMetadata


def split_state(spec: AttentionSpec, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of every slot's flat float32 state: (conv inputs [slots, kernel - 1, channels], S
    [slots, H, head_size, state_size])."""
    return kda_torch.split_state(spec, states, spec.state_size)


def time_steps(spec: AttentionSpec, dt: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """Δ = clamp(softplus(dt + dt_bias), *dt_limit) in float32, [..., H]."""
    low, high = spec.dt_limit
    return F.softplus(dt.float() + dt_bias.float()).clamp(low, high)


def split_activated(spec: AttentionSpec, activated: torch.Tensor):
    """[..., channels] -> x [..., H, head_size], B and C [..., G, state_size]."""
    heads, groups = spec.num_heads, spec.num_groups
    x, b, c = activated.split([heads * spec.head_size, groups * spec.state_size, groups * spec.state_size], dim=-1)
    lead = activated.shape[:-1]
    return (
        x.reshape(*lead, heads, spec.head_size),
        b.reshape(*lead, groups, spec.state_size),
        c.reshape(*lead, groups, spec.state_size),
    )


def prepare(
    spec: AttentionSpec,
    xbc: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    dt: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    metadata: Mamba2Metadata,
):
    """The step's inputs padded per sequence and convolved, the convolution inputs saved back
    to the slots. Returns x [B, rows, H, head_size], B and C [B, rows, G, state_size], Δ [B,
    rows, H] (float32, 0 on padding) and the initial S [B, H, head_size, state_size] (zeros for
    fresh sequences)."""
    convolved, initial = kda_torch.convolve_padded(
        spec, xbc, conv_weight, conv_bias, state, metadata, last=spec.state_size
    )
    activated = F.silu(convolved).to(xbc.dtype).float()  # [B, rows, C]
    num_seqs, rows = metadata.common.num_seqs, metadata.common.max_query_len
    seq, row = metadata.token_seq, metadata.token_row
    x, b, c = split_activated(spec, activated)
    delta = dt.new_zeros(num_seqs, rows, spec.num_heads, dtype=torch.float32)
    delta[seq, row] = time_steps(spec, dt, dt_bias)
    return x, b, c, delta, initial


def heads_of_groups(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[..., G, N] -> [..., H, N]: head ``h`` reads group ``h // (H / G)``."""
    return t.repeat_interleave(heads // t.shape[-2], dim=-2)


def recurrent_step(x, delta, A, b, c, D, state):
    """One token per sequence. x [B, H, P]; Δ [B, H]; A, D [H]; B, C [B, G, N]; state
    [B, H, P, N] -> (y [B, H, P], new state), float32."""
    heads = x.shape[1]
    b, c = heads_of_groups(b, heads), heads_of_groups(c, heads)
    decay = (delta * A.float()).exp()  # [B, H]
    state = state * decay[..., None, None] + (delta[..., None] * x)[..., None] * b[:, :, None, :]
    y = torch.einsum("bhpn,bhn->bhp", state, c) + D.float()[:, None] * x
    return y, state


def segment_sums(a: torch.Tensor) -> torch.Tensor:
    """[..., L] -> [..., L, L]: entry (i, j) is ``a_{j+1} + ... + a_i`` for j <= i, -inf above
    (summed as masked cumulative sums, not differences of them, for strong decays)."""
    length = a.shape[-1]
    expanded = a[..., None].expand(*a.shape, length)  # entry (i, j) = a_i
    strictly_lower = torch.ones(length, length, dtype=torch.bool, device=a.device).tril(-1)
    sums = expanded.masked_fill(~strictly_lower, 0.0).cumsum(dim=-2)
    causal = torch.ones(length, length, dtype=torch.bool, device=a.device).tril()
    return sums.masked_fill(~causal, float("-inf"))


def chunked(x, delta, A, b, c, D, state, chunk: int = CHUNK):
    """The chunked form. x [B, L, H, P]; Δ [B, L, H]; A, D [H]; B, C [B, L, G, N]; state
    [B, H, P, N] -> (y [B, L, H, P], final state), float32."""
    num_seqs, length, heads, head_size = x.shape
    chunk = min(chunk, length)
    pad = (-length) % chunk  # zero rows (Δ = 0): the state passes them unchanged

    def chunks(t: torch.Tensor) -> torch.Tensor:  # [B, L, ...] -> [B, chunks, chunk, ...]
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
        return t.reshape(num_seqs, -1, chunk, *t.shape[2:])

    xs = chunks(x * delta[..., None])  # [B, c, l, H, P]: the input Δ · x
    b, c = chunks(heads_of_groups(b, heads)), chunks(heads_of_groups(c, heads))  # [B, c, l, H, N]
    a = chunks(delta * A.float()).permute(0, 3, 1, 2)  # [B, H, c, l]: log decays
    a_cumsum = a.cumsum(dim=-1)
    # within chunks: y_i = Σ_{j <= i} exp(a_{j+1} + ... + a_i) (C_i · B_j) Δ_j x_j
    decays = segment_sums(a).exp()  # [B, H, c, l, l]
    scores = torch.einsum("bclhn,bcshn->bhcls", c, b) * decays
    y = torch.einsum("bhcls,bcshp->bclhp", scores, xs)
    # each chunk's own contribution to the state at its end
    to_end = (a_cumsum[..., -1:] - a_cumsum).exp()  # [B, H, c, l]
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", b, to_end, xs)
    # across chunks: the state entering each chunk, from the initial state and earlier chunks
    states = torch.cat([state[:, None].float(), states], dim=1)  # [B, c + 1, H, P, N]
    chunk_decays = segment_sums(F.pad(a_cumsum[..., -1], (1, 0))).exp()  # [B, H, c + 1, c + 1]
    entering = torch.einsum("bhzc,bchpn->bzhpn", chunk_decays, states)
    entering, final = entering[:, :-1], entering[:, -1]
    y = y + torch.einsum("bclhn,bchpn,bhcl->bclhp", c, entering, a_cumsum.exp())
    y = y.reshape(num_seqs, -1, heads, head_size)[:, :length]
    return y + D.float()[:, None] * x, final


def forward_chunked(
    spec: AttentionSpec,
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
    """``forward_mamba2`` of any step in the chunked form: y [T, H, head_size] float32."""
    x, b, c, delta, initial = prepare(spec, xbc, conv_weight, conv_bias, dt, dt_bias, state, metadata)
    y, final = chunked(x, delta, A, b, c, D, initial)
    split_state(spec, state)[1][metadata.common.state_slots] = final
    return y[metadata.token_seq, metadata.token_row]


def forward_decode(
    spec: AttentionSpec,
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
    """``forward_mamba2`` of a step of one token a sequence (token t of sequence t), batched:
    the convolution one product over [kept inputs; the new one], then one recurrence step."""
    slots, fresh = metadata.common.state_slots, metadata.fresh
    conv_states, ssm_states = split_state(spec, state)
    window = torch.cat([conv_states[slots], xbc.float()[:, None]], dim=1)  # [B, kernel, C]
    window[:, :-1].masked_fill_(fresh[:, None, None], 0.0)  # no host sync: graph-capturable
    initial = ssm_states[slots].masked_fill(fresh[:, None, None, None], 0.0)
    conv_states[slots] = window[:, 1:]
    convolved = torch.einsum("bkc,ck->bc", window, conv_weight.float())
    if conv_bias is not None:
        convolved = convolved + conv_bias.float()
    x, b, c = split_activated(spec, F.silu(convolved).to(xbc.dtype).float())
    y, final = recurrent_step(x, time_steps(spec, dt, dt_bias), A, b, c, D, initial)
    ssm_states[slots] = final
    return y
