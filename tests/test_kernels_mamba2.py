"""The Mamba-2 selective scan's torch forms (engine.kernels.mamba2_torch: chunked SSD and the
one-token step) and the backends serving kind ``mamba2``, against a naive token-by-token
recurrence: ragged batches with padding, chunk boundaries, strong decays, state slots carried
from step to step and reset for fresh sequences."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from engine.interfaces.attention import MAMBA2, AttentionSpec, CommonAttentionMetadata
from engine.kernels.mamba2_torch import chunked, recurrent_step, split_state


def make_spec(heads=4, head_size=8, state_size=6, groups=2, kernel=4, dt_limit=(0.0, math.inf)) -> AttentionSpec:
    return AttentionSpec(
        MAMBA2, heads, heads, head_size, 1.0, conv_kernel=kernel, state_size=state_size, num_groups=groups,
        dt_limit=dt_limit,
    )  # fmt: skip


def naive_scan(x, delta, A, b, c, D, state):
    """Token by token, one head at a time: S = exp(Δ A) S + Δ x Bᵀ, y = S C + D x.
    x [L, H, P], Δ [L, H], B, C [L, G, N], state [H, P, N] -> (y [L, H, P], state)."""
    length, heads, _ = x.shape
    per_group = heads // b.shape[1]
    state = state.clone()
    y = torch.zeros_like(x)
    for t in range(length):
        for h in range(heads):
            g = h // per_group
            state[h] = math.exp(delta[t, h] * A[h]) * state[h] + delta[t, h] * torch.outer(x[t, h], b[t, g])
            y[t, h] = state[h] @ c[t, g] + D[h] * x[t, h]
    return y, state


def naive_mixer(spec, xbc, conv_weight, conv_bias, dt, dt_bias, A, D, kept, state):
    """One sequence's step from its kept convolution inputs [kernel - 1, C] and SSM state:
    (y [L, H, P], new kept inputs, new state), as the forward_mamba2 contract states it."""
    inputs = torch.cat([kept, xbc.float()])
    k = spec.conv_kernel
    convolved = torch.stack([(inputs[t : t + k].T * conv_weight).sum(-1) for t in range(xbc.shape[0])])
    if conv_bias is not None:
        convolved = convolved + conv_bias
    activated = F.silu(convolved).to(xbc.dtype).float()
    hp, gn = spec.num_heads * spec.head_size, spec.num_groups * spec.state_size
    x, b, c = activated.split([hp, gn, gn], dim=-1)
    delta = F.softplus(dt.float() + dt_bias).clamp(*spec.dt_limit)
    y, state = naive_scan(
        x.reshape(-1, spec.num_heads, spec.head_size), delta, A, b.reshape(-1, spec.num_groups, spec.state_size),
        c.reshape(-1, spec.num_groups, spec.state_size), D, state,
    )  # fmt: skip
    return y, inputs[-(k - 1) :], state


def random_scan_inputs(gen, lengths, heads=3, head_size=5, state_size=4, groups=1, decay_scale=1.0):
    num_seqs, rows = len(lengths), max(lengths)
    x = torch.randn(num_seqs, rows, heads, head_size, generator=gen)
    delta = torch.rand(num_seqs, rows, heads, generator=gen) * decay_scale
    valid = torch.arange(rows)[None, :] < torch.tensor(lengths)[:, None]
    delta = delta * valid[..., None]  # padding: Δ = 0
    A = -torch.rand(heads, generator=gen) * 2 - 0.1
    b = torch.randn(num_seqs, rows, groups, state_size, generator=gen)
    c = torch.randn(num_seqs, rows, groups, state_size, generator=gen)
    D = torch.randn(heads, generator=gen)
    state = torch.randn(num_seqs, heads, head_size, state_size, generator=gen)
    return x, delta, A, b, c, D, state, valid


@pytest.mark.parametrize("lengths", [[1], [5, 70, 1], [64, 63, 65], [130, 7]])
@pytest.mark.parametrize("groups", [1, 3])
def test_the_chunked_form_matches_the_recurrence(lengths, groups):
    """Ragged sequences padded to the longest (padding rows Δ = 0), across the 64-token chunk
    edges and past two chunks, from random states: outputs on each sequence's rows and final
    states equal the token-by-token recurrence."""
    gen = torch.Generator().manual_seed(sum(lengths) + groups)
    x, delta, A, b, c, D, state, valid = random_scan_inputs(gen, lengths, heads=3, groups=groups)
    y, final = chunked(x, delta, A, b, c, D, state)
    for i, n in enumerate(lengths):
        expected, expected_state = naive_scan(x[i, :n], delta[i, :n], A, b[i, :n], c[i, :n], D, state[i])
        torch.testing.assert_close(y[i, :n], expected, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(final[i], expected_state, atol=1e-4, rtol=1e-4)


def test_the_chunked_form_survives_strong_decays():
    """Time steps up to 40 with A down to -2.1 (log decays of -80 a token, -5000 over a chunk):
    the decays within a chunk are summed segments, never exp of a cumulative sum's
    difference taken apart, so everything stays finite and equals the recurrence."""
    gen = torch.Generator().manual_seed(3)
    lengths = [100, 37]
    x, delta, A, b, c, D, state, _ = random_scan_inputs(gen, lengths, decay_scale=40.0)
    y, final = chunked(x, delta, A, b, c, D, state)
    assert torch.isfinite(y).all() and torch.isfinite(final).all()
    for i, n in enumerate(lengths):
        expected, expected_state = naive_scan(x[i, :n], delta[i, :n], A, b[i, :n], c[i, :n], D, state[i])
        torch.testing.assert_close(y[i, :n], expected, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(final[i], expected_state, atol=1e-4, rtol=1e-4)


def test_one_recurrent_step_matches_the_recurrence():
    gen = torch.Generator().manual_seed(5)
    x, delta, A, b, c, D, state, _ = random_scan_inputs(gen, [1, 1, 1], groups=3)
    y, final = recurrent_step(x[:, 0], delta[:, 0], A, b[:, 0], c[:, 0], D, state)
    for i in range(3):
        expected, expected_state = naive_scan(x[i], delta[i], A, b[i], c[i], D, state[i])
        torch.testing.assert_close(y[i], expected[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(final[i], expected_state, atol=1e-5, rtol=1e-5)


def common_metadata(context_lens, query_lens, slots) -> CommonAttentionMetadata:
    query_lens_t = torch.tensor(query_lens)
    context_t = torch.tensor(context_lens)
    starts = torch.zeros(len(query_lens) + 1, dtype=torch.long)
    starts[1:] = query_lens_t.cumsum(0)
    return CommonAttentionMetadata(
        query_start_loc=starts,
        query_lens=query_lens_t,
        context_lens=context_t,
        seq_lens=context_t + query_lens_t,
        block_tables=torch.zeros(len(query_lens), 1, dtype=torch.long),
        slot_mapping=torch.zeros(int(query_lens_t.sum()), dtype=torch.long),
        max_query_len=max(query_lens),
        max_seq_len=int((context_t + query_lens_t).max()),
        block_size=16,
        state_slots=torch.tensor(slots),
    )


class Layer:
    """One Mamba-2 layer's random weights."""

    def __init__(self, spec, gen, with_bias=True):
        channels = spec.conv_channels
        self.conv_weight = torch.randn(channels, spec.conv_kernel, generator=gen) * 0.5
        self.conv_bias = torch.randn(channels, generator=gen) * 0.1 if with_bias else None
        self.dt_bias = torch.randn(spec.num_heads, generator=gen) * 0.5
        self.A = -torch.rand(spec.num_heads, generator=gen) * 3 - 0.05
        self.D = torch.randn(spec.num_heads, generator=gen)

    def args(self):
        return self.conv_weight, self.conv_bias, self.dt_bias, self.A, self.D


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias, dt_limit", [(True, (0.0, math.inf)), (False, (0.05, 0.8))])
def test_cpu_mamba2_serves_steps_of_prefill_chunks_and_decodes(dtype, with_bias, dt_limit):
    from engine_cpu.mamba2 import CpuMamba2

    check_backend_steps(CpuMamba2, dtype, with_bias, dt_limit)


def check_backend_steps(cls, dtype, with_bias, dt_limit):
    """Three requests in slots 2, 0 and 3 (slot 1 unused) whose slots hold garbage at first:
    a prefill step of ragged chunks (one request fresh, one continuing a cached context, one
    over 64 tokens), then decode steps of all three, then a mixed step. Every output and every
    state matches the naive recurrence from the requests' own history."""
    spec = make_spec(heads=4, head_size=8, state_size=6, groups=2, kernel=4, dt_limit=dt_limit)
    impl = cls(spec, 16, dtype, torch.device("cpu"))
    gen = torch.Generator().manual_seed(11)
    layer = Layer(spec, gen, with_bias)
    conv_weight, conv_bias, dt_bias, A, D = layer.args()
    state = torch.randn(4, spec.state_numel(), generator=gen).to(impl.cache_dtype(dtype))
    slots = [2, 0, 3]
    width = spec.conv_kernel - 1
    # each request's reference state: (kept conv inputs, SSM state); request 1 starts mid-sequence
    kept = [torch.zeros(width, spec.conv_channels) for _ in slots]
    ssm = [torch.zeros(spec.num_heads, spec.head_size, spec.state_size) for _ in slots]
    conv_view, ssm_view = split_state(spec, state)
    conv_view[0], ssm_view[0] = (
        torch.randn(width, spec.conv_channels, generator=gen),
        torch.randn(spec.num_heads, spec.head_size, spec.state_size, generator=gen),
    )
    kept[1], ssm[1] = conv_view[0].clone(), ssm_view[0].clone()
    context = [0, 20, 0]
    for query_lens in ([5, 9, 70], [1, 1, 1], [1, 1, 1], [3, 1, 17]):
        total = sum(query_lens)
        xbc = torch.randn(total, spec.conv_channels, generator=gen).to(dtype)
        dt = torch.randn(total, spec.num_heads, generator=gen).to(dtype)
        metadata = impl.build_metadata(common_metadata(context, query_lens, slots))
        y = impl.forward_mamba2(xbc, conv_weight, conv_bias, dt, dt_bias, A, D, state, metadata)
        assert y.shape == (total, spec.num_heads, spec.head_size) and y.dtype == torch.float32
        start = 0
        for i, n in enumerate(query_lens):
            rows = slice(start, start + n)
            expected, kept[i], ssm[i] = naive_mixer(
                spec, xbc[rows], conv_weight, conv_bias, dt[rows], dt_bias, A, D, kept[i], ssm[i]
            )
            torch.testing.assert_close(y[rows], expected, atol=1e-4, rtol=1e-4)
            conv_view, ssm_view = split_state(spec, state)
            torch.testing.assert_close(conv_view[slots[i]], kept[i], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(ssm_view[slots[i]], ssm[i], atol=1e-4, rtol=1e-4)
            start += n
        context = [c + n for c, n in zip(context, query_lens)]


def test_a_spec_without_its_sizes_is_refused():
    from engine_cpu.mamba2 import CpuMamba2

    spec = AttentionSpec(MAMBA2, 4, 4, 8, 1.0, conv_kernel=4, state_size=None, num_groups=3)
    reasons = CpuMamba2.validate(spec, platform="cpu", dtype="float32", block_size=16)
    assert "state_size must be set (got None)" in reasons
    assert "num_groups must divide num_heads 4 (got 3)" in reasons
    assert any(r.startswith("dt_limit must be") for r in reasons)
    good = make_spec()
    assert CpuMamba2.validate(good, platform="cpu", dtype="float32", block_size=16) == []
    assert good.is_recurrent and good.kv_bytes_per_token(4) == 0
    assert good.state_numel() == 3 * (4 * 8 + 2 * 2 * 6) + 4 * 8 * 6
