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

Sequences with no cached tokens start from zeros, whatever their slot held before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.interfaces.attention import (
    LINEAR,
    AttentionBackend,
    AttentionCapabilities,
    AttentionSpec,
    CommonAttentionMetadata,
)

CHUNK = 64


@dataclass
class CpuKdaMetadata:
    common: CommonAttentionMetadata
    token_seq: torch.Tensor  # [T] the sequence of each new token
    token_row: torch.Tensor  # [T] its row within the sequence's new tokens
    fresh: torch.Tensor  # [B] True where the sequence starts from a zero state


class CpuKdaAttention(AttentionBackend):
    name = "cpu_kda"
    capabilities = AttentionCapabilities(
        kinds=frozenset({LINEAR}),
        platforms=frozenset({"cpu"}),
        dtypes=frozenset({"float32", "bfloat16"}),
    )

    def __init__(self, spec: AttentionSpec, block_size: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(spec, block_size, dtype, device)
        reasons = linear_spec_reasons(spec)
        if reasons:
            raise ValueError(f"cpu_kda cannot serve {spec}: {'; '.join(reasons)}.")

    @classmethod
    def validate(
        cls, spec: AttentionSpec, *, platform: str, dtype: str, block_size: int, kv_cache_dtype: str = "auto"
    ) -> list[str]:
        reasons = super().validate(
            spec, platform=platform, dtype=dtype, block_size=block_size, kv_cache_dtype=kv_cache_dtype
        )
        if spec.kind == LINEAR:
            reasons += linear_spec_reasons(spec)
        return reasons

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        # one flat float32 state per slot
        return (num_blocks, self.spec.state_numel())

    def cache_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float32

    def build_metadata(self, common: CommonAttentionMetadata) -> CpuKdaMetadata:
        device = common.query_lens.device
        token_seq = torch.repeat_interleave(torch.arange(common.num_seqs, device=device), common.query_lens)
        token_row = torch.arange(token_seq.shape[0], device=device) - common.query_start_loc[token_seq]
        return CpuKdaMetadata(common, token_seq, token_row, common.context_lens == 0)

    def forward(self, q, k, v, kv_cache, metadata):
        """Linear attention runs through :meth:`forward_linear`."""
        raise NotImplementedError("cpu_kda serves linear attention through forward_linear")

    def split_state(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of every slot's (conv inputs [slots, kernel - 1, channels], S [slots, H, dk, dv])."""
        spec = self.spec
        conv_numel = (spec.conv_kernel - 1) * spec.conv_channels
        conv = states[:, :conv_numel].view(-1, spec.conv_kernel - 1, spec.conv_channels)
        recurrent = states[:, conv_numel:].view(-1, spec.num_heads, spec.head_size, spec.value_size)
        return conv, recurrent

    def forward_linear(
        self, mixed_qkv: torch.Tensor, conv_weight: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
        state: torch.Tensor, metadata: CpuKdaMetadata,
    ) -> torch.Tensor:
        spec, common = self.spec, metadata.common
        heads, dk, dv, width = spec.num_heads, spec.head_size, spec.value_size, spec.conv_kernel - 1
        slots = common.state_slots
        conv_states, recurrent_states = self.split_state(state)
        fresh = metadata.fresh[:, None, None]
        kept = conv_states[slots].masked_fill(fresh, 0.0)  # [B, kernel - 1, C]
        initial = recurrent_states[slots].masked_fill(fresh[..., None], 0.0)  # [B, H, dk, dv]
        num_seqs, rows = common.num_seqs, common.max_query_len
        seq, row = metadata.token_seq, metadata.token_row
        # the step's inputs padded per sequence: [B, rows, C] after the kept ones
        inputs = mixed_qkv.new_zeros(num_seqs, width + rows, spec.conv_channels, dtype=torch.float32)
        inputs[:, :width] = kept
        inputs[seq, width + row] = mixed_qkv.float()
        weight = conv_weight.float()  # [C, kernel]
        windows = inputs.unfold(1, spec.conv_kernel, 1)  # [B, rows, C, kernel]
        activated = F.silu(torch.einsum("btck,ck->btc", windows, weight))  # [B, rows, C]
        # the convolution inputs kept for the next step: each sequence's last kernel - 1
        ends = common.query_lens[:, None] + torch.arange(width, device=state.device)[None, :]  # [B, kernel - 1]
        conv_states[slots] = inputs[torch.arange(num_seqs, device=state.device)[:, None], ends]
        q, k, v = activated.split([heads * dk, heads * dk, heads * dv], dim=-1)
        q = l2_normalize(q.view(num_seqs, rows, heads, dk)) * spec.scale
        k = l2_normalize(k.view(num_seqs, rows, heads, dk))
        v = v.reshape(num_seqs, rows, heads, dv)
        # gates and betas padded likewise (zeros: the padding leaves the state alone)
        decay = g.new_zeros(num_seqs, rows, heads, dk, dtype=torch.float32)
        decay[seq, row] = g.float()
        strength = beta.new_zeros(num_seqs, rows, heads, dtype=torch.float32)
        strength[seq, row] = beta.float()
        k = k * (strength > 0)[..., None]  # padded rows: k = 0 too
        if rows == 1:
            out, final = recurrent_step(q[:, 0], k[:, 0], v[:, 0], decay[:, 0], strength[:, 0], initial)
            out = out.unsqueeze(1)
        else:
            out, final = chunked(q, k, v, decay, strength, initial)
        recurrent_states[slots] = final
        return out[seq, row].to(mixed_qkv.dtype)  # [T, H, dv]


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
    [B, H, dk, dv] -> (o [B, L, H, dv], final state)."""
    num_seqs, length, heads, dk = k.shape
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


def linear_spec_reasons(spec: AttentionSpec) -> list[str]:
    """Why ``spec`` is not a well-formed linear-attention spec."""
    reasons = []
    if spec.value_size is None or spec.value_size < 1:
        reasons.append(f"value_size must be set (got {spec.value_size})")
    if spec.conv_kernel is None or spec.conv_kernel < 2:
        reasons.append(f"conv_kernel must be at least 2 (got {spec.conv_kernel})")
    return reasons
