"""Kimi delta attention in torch: the forms the engine's KDA backends share and the Triton
kernels are checked against.

- :func:`prepare` runs the short convolution for a step's sequences padded to
  [sequences, rows] (the inputs kept from earlier steps first), keeps each sequence's last
  ``kernel - 1`` inputs, and returns the normalised q, k and v, the gates and betas, padded;
  padding rows have ``k = 0``, ``β = 0``, ``g = 0``, so they leave a state unchanged.
- :func:`recurrent_step` is one token per sequence; :func:`chunked` the chunked form (WY
  representation within chunks of 64, the state carried across chunks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.interfaces.attention import AttentionSpec, CommonAttentionMetadata

CHUNK = 64


@dataclass
class StateMetadata:
    """A step's metadata for the kinds that keep a state per request (KDA, and Mamba-2 too)."""

    common: CommonAttentionMetadata
    token_seq: torch.Tensor  # [T] the sequence of each new token
    token_row: torch.Tensor  # [T] its row within the sequence's new tokens
    fresh: torch.Tensor  # [B] True where the sequence starts from a zero state


KdaMetadata = StateMetadata


def build_metadata(common: CommonAttentionMetadata) -> StateMetadata:
    return StateMetadata(common, common.token_seq, common.token_row, common.context_lens == 0)


def split_state(
    spec: AttentionSpec, states: torch.Tensor, last: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of every slot's flat float32 state: (conv inputs [slots, kernel - 1, channels], S
    [slots, H, head_size, last]); ``last`` is the spec's value_size unless given (Mamba-2 passes
    its state_size)."""
    conv_numel = (spec.conv_kernel - 1) * spec.conv_channels
    conv = states[:, :conv_numel].view(-1, spec.conv_kernel - 1, spec.conv_channels)
    recurrent = states[:, conv_numel:].view(-1, spec.num_heads, spec.head_size, last or spec.value_size)
    return conv, recurrent


def convolve_padded(
    spec: AttentionSpec,
    inputs: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    state: torch.Tensor,
    metadata: StateMetadata,
    last: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The short convolution of a step's sequences padded to [sequences, rows]: each sequence's
    kept inputs (zeros for fresh sequences) first, then its new tokens' ``inputs`` [T, channels].
    Saves each sequence's last ``kernel - 1`` inputs back to its slot. Returns the convolution
    [B, rows, channels] (float32, before the activation) and the initial S [B, H, head_size,
    last] (zeros for fresh sequences); ``last`` as for :func:`split_state`."""
    common = metadata.common
    width = spec.conv_kernel - 1
    slots = common.state_slots
    conv_states, recurrent_states = split_state(spec, state, last)
    fresh = metadata.fresh[:, None, None]
    kept = conv_states[slots].masked_fill(fresh, 0.0)  # [B, kernel - 1, C]
    initial = recurrent_states[slots].masked_fill(fresh[..., None], 0.0)  # [B, H, head_size, last]
    num_seqs, rows = common.num_seqs, common.max_query_len
    padded = inputs.new_zeros(num_seqs, width + rows, spec.conv_channels, dtype=torch.float32)
    padded[:, :width] = kept
    padded[metadata.token_seq, width + metadata.token_row] = inputs.float()
    windows = padded.unfold(1, spec.conv_kernel, 1)  # [B, rows, C, kernel]
    convolved = torch.einsum("btck,ck->btc", windows, conv_weight.float())
    if conv_bias is not None:
        convolved = convolved + conv_bias.float()
    # the convolution inputs kept for the next step: each sequence's last kernel - 1
    ends = common.query_lens[:, None] + torch.arange(width, device=state.device)[None, :]
    conv_states[slots] = padded[torch.arange(num_seqs, device=state.device)[:, None], ends]
    return convolved, initial


def prepare(
    spec: AttentionSpec,
    mixed_qkv: torch.Tensor,
    conv_weight: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    metadata: StateMetadata,
):
    """The step's inputs padded per sequence and convolved, the convolution inputs saved back to
    the slots. Returns q, k, g [B, rows, H, head_size], v [B, rows, H, value_size], beta [B, rows,
    H] (float32) and the initial S [B, H, head_size, value_size] (zeros for fresh sequences)."""
    heads, dk, dv = spec.num_heads, spec.head_size, spec.value_size
    convolved, initial = convolve_padded(spec, mixed_qkv, conv_weight, None, state, metadata)
    activated = F.silu(convolved)  # [B, rows, C]
    num_seqs, rows = metadata.common.num_seqs, metadata.common.max_query_len
    seq, row = metadata.token_seq, metadata.token_row
    q, k, v = activated.split([heads * dk, heads * dk, heads * dv], dim=-1)
    q = l2_normalize(q.view(num_seqs, rows, heads, dk)) * spec.scale
    k = l2_normalize(k.view(num_seqs, rows, heads, dk))
    v = v.reshape(num_seqs, rows, heads, dv)
    decay = g.new_zeros(num_seqs, rows, heads, dk, dtype=torch.float32)
    decay[seq, row] = g.float()
    strength = beta.new_zeros(num_seqs, rows, heads, dtype=torch.float32)
    strength[seq, row] = beta.float()
    valid = torch.zeros(num_seqs, rows, dtype=torch.bool, device=state.device)
    valid[seq, row] = True
    k = k * valid[..., None, None]  # padded rows: k = 0 too
    return q, k, v, decay, strength, initial


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def recurrent_step(q, k, v, g, beta, state):
    """One token per sequence. q, k, g: [B, H, dk]; v: [B, H, dv]; beta: [B, H]; state [B, H, dk, dv]."""
    state = state * g.exp()[..., None]
    remembered = torch.einsum("bhkv,bhk->bhv", state, k)
    state = state + k[..., None] * ((v - remembered) * beta[..., None])[..., None, :]
    return torch.einsum("bhkv,bhk->bhv", state, q), state


def chunked(q, k, v, g, beta, state, chunk: int = CHUNK):
    """The chunked form. q, k, g: [B, L, H, dk]; v: [B, L, H, dv]; beta: [B, L, H]; state
    [B, H, dk, dv] -> (o [B, L, H, dv], final state). Gates equal across each head's
    channels (gated DeltaNet's one decay a head) take :func:`chunked_head_gates`."""
    if bool((g == g[..., :1]).all()):
        return chunked_head_gates(q, k, v, g[..., 0], beta, state, chunk)
    num_seqs, length, heads, dk = k.shape
    chunk = min(chunk, length)  # a short step (verifying drafts) is one chunk of its own length
    pad = (-length) % chunk  # zero rows, as the step's own padding: the state passes them unchanged

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [B, L, H, d] -> [B, H, chunks, chunk, d]
        x = F.pad(x, (0, 0, 0, 0, 0, pad))
        return x.transpose(1, 2).reshape(num_seqs, heads, -1, chunk, x.shape[-1])

    q, k, v, g = (chunks(x) for x in (q, k, v, g))
    beta = F.pad(beta, (0, 0, 0, pad)).transpose(1, 2).reshape(num_seqs, heads, -1, chunk)
    g = g.cumsum(dim=-2)  # within each chunk
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril(-1)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    eye = torch.eye(chunk, device=q.device)
    out = torch.empty_like(v)
    for c in range(q.shape[2]):
        qc, kc, gc = q[:, :, c], k[:, :, c], g[:, :, c]
        # decay from token j to token i per channel, exp(g_i - g_j), for j <= i
        decay = (gc[..., :, None, :] - gc[..., None, :, :]).masked_fill(~causal[..., None], float("-inf")).exp()
        # WY representation: T = (I + strictly lower(β_i k_i · decay · k_j))⁻¹
        interactions = torch.einsum("bhid,bhjd,bhijd->bhij", k_beta[:, :, c], kc, decay).masked_fill(~lower, 0.0)
        solve = torch.linalg.solve_triangular(eye + interactions, eye.expand_as(interactions), upper=False)
        u = solve @ v_beta[:, :, c]  # [B, H, chunk, dv]
        w = solve @ (k_beta[:, :, c] * gc.exp())  # [B, H, chunk, dk]
        new_values = u - w @ state
        within = torch.einsum("bhid,bhjd,bhijd->bhij", qc, kc, decay)
        out[:, :, c] = (qc * gc.exp()) @ state + within @ new_values
        last = gc[:, :, -1:]  # [B, H, 1, dk]
        state = state * last.transpose(-1, -2).exp() + (kc * (last - gc).exp()).transpose(-1, -2) @ new_values
    out = out.reshape(num_seqs, heads, -1, v.shape[-1])[:, :, :length].transpose(1, 2)
    return out, state


def chunked_head_gates(q, k, v, g, beta, state, chunk: int = CHUNK):
    """:func:`chunked` with one gate per head and token, g [B, L, H] (the same for all of
    the head's channels): the decays between tokens are a [chunk, chunk] matrix per head,
    so the products within a chunk are plain matrix products scaled by it."""
    num_seqs, length, heads, dk = k.shape
    chunk = min(chunk, length)
    pad = (-length) % chunk

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [B, L, H, d] -> [B, H, chunks, chunk, d]
        x = F.pad(x, (0, 0, 0, 0, 0, pad))
        return x.transpose(1, 2).reshape(num_seqs, heads, -1, chunk, x.shape[-1])

    def rows(x: torch.Tensor) -> torch.Tensor:  # [B, L, H] -> [B, H, chunks, chunk]
        return F.pad(x, (0, 0, 0, pad)).transpose(1, 2).reshape(num_seqs, heads, -1, chunk)

    q, k, v = (chunks(x) for x in (q, k, v))
    g, beta = rows(g).cumsum(dim=-1), rows(beta)  # g within each chunk
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril(-1)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    eye = torch.eye(chunk, device=q.device)
    # decay from token j to token i, exp(g_i - g_j), for j <= i: [B, H, chunks, chunk, chunk]
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    interactions = (k_beta @ k.transpose(-1, -2) * decay).masked_fill(~lower, 0.0)
    solve = torch.linalg.solve_triangular(eye + interactions, eye.expand_as(interactions), upper=False)
    u = solve @ v_beta  # [B, H, chunks, chunk, dv]
    w = solve @ (k_beta * g.exp()[..., None])  # [B, H, chunks, chunk, dk]
    within = q @ k.transpose(-1, -2) * decay
    q_decayed = q * g.exp()[..., None]
    last = g[..., -1:]  # [B, H, chunks, 1]
    k_decayed = k * (last - g).exp()[..., None]
    out = torch.empty_like(v)
    for c in range(q.shape[2]):
        new_values = u[:, :, c] - w[:, :, c] @ state
        out[:, :, c] = q_decayed[:, :, c] @ state + within[:, :, c] @ new_values
        state = state * last[:, :, c, :, None].exp() + k_decayed[:, :, c].transpose(-1, -2) @ new_values
    out = out.reshape(num_seqs, heads, -1, v.shape[-1])[:, :, :length].transpose(1, 2)
    return out, state
