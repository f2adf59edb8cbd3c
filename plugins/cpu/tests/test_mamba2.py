"""cpu_mamba2's chunked prefill and its decode step (native kernels of each instruction-set
build, and the torch path) against the Mamba-2 recurrence token by token: lengths around the
chunk edges, several sequences of different lengths in one step, sequences continuing a state
beside fresh ones."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from cpu_isa import ISA_VARIANTS, use_isa

from engine.interfaces.attention import MAMBA2, AttentionSpec
from engine.testing.kit.attention.base import make_common_metadata
from engine_cpu.mamba2 import CHUNK, CpuMamba2

HEADS, HEAD_SIZE, STATE_SIZE, GROUPS, KERNEL = 4, 8, 16, 2, 4
# one step's sequences: new tokens (a prefill, or a decode step) and cached tokens (those with
# some continue a state)
STEPS = {"prefill": [1, 7, CHUNK - 1, CHUNK + 1, 300], "decode": [1, 1, 1, 1, 1]}
CACHED = [5, 0, 9, 3, 0]


@pytest.fixture(params=[*(f"native-{isa}" for isa in ISA_VARIANTS), "torch"])
def path(request, monkeypatch):
    """Which implementation runs: the C++ kernels of one instruction-set build, or torch."""
    if request.param != "torch":
        use_isa(monkeypatch, request.param.removeprefix("native-"))
    return request.param


def make_backend(spec: AttentionSpec, dtype: torch.dtype, path: str) -> CpuMamba2:
    backend = CpuMamba2(spec, 16, dtype, torch.device("cpu"))
    if path == "torch":
        backend.kernels = None
    else:
        assert backend.kernels is not None and backend.kernels.variant == path.removeprefix("native-")
    return backend


def naive_scan(spec, kept, ssm, xbc, conv_weight, conv_bias, dt, dt_bias, A, D):
    """One sequence token by token, as the contract states it: the convolution over [kept
    inputs; xbc], SiLU, rounded to xbc's dtype; Δ = clamp(softplus(dt + dt_bias), *dt_limit);
    per head S = exp(Δ A) S + Δ x Bᵀ, y = S C + D x. kept [kernel - 1, C], ssm [H, P, N] float32.
    Returns (y [L, H, P], the last kernel - 1 inputs, S)."""
    per_group = HEADS // GROUPS
    inputs = torch.cat([kept, xbc.float()])
    state = ssm.clone()
    ys = []
    for t in range(xbc.shape[0]):
        convolved = (inputs[t : t + KERNEL] * conv_weight.float().T).sum(0)
        if conv_bias is not None:
            convolved = convolved + conv_bias.float()
        activated = F.silu(convolved).to(xbc.dtype).float()
        x, b, c = activated.split([HEADS * HEAD_SIZE, GROUPS * STATE_SIZE, GROUPS * STATE_SIZE])
        x, b, c = x.view(HEADS, HEAD_SIZE), b.view(GROUPS, STATE_SIZE), c.view(GROUPS, STATE_SIZE)
        delta = F.softplus(dt[t].float() + dt_bias).clamp(*spec.dt_limit)
        y = torch.empty(HEADS, HEAD_SIZE)
        for h in range(HEADS):
            g = h // per_group
            state[h] = torch.exp(delta[h] * A[h]) * state[h] + delta[h] * torch.outer(x[h], b[g])
            y[h] = state[h] @ c[g] + D[h] * x[h]
        ys.append(y)
    return torch.stack(ys), inputs[-(KERNEL - 1) :], state


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("decays", ["moderate", "strong"])
@pytest.mark.parametrize("step", list(STEPS))
def test_step_matches_recurrence(path, step, dtype, decays):
    """One step of five sequences (prefill: 1, 7, CHUNK - 1, CHUNK + 1 and 300 new tokens;
    decode: one each), three of them continuing a cached state (kept convolution inputs and S)
    and two fresh ones in slots holding garbage; a nonzero dt bias and a narrow dt_limit.
    Outputs and each slot's new state match the token-by-token recurrence; slots outside the
    step keep their bytes. "strong": decays of thousands within a chunk (the scores' exponents
    far below float32's range)."""
    lengths = STEPS[step]
    dtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(len(decays) + (dtype == torch.bfloat16))
    limit = (0.05, 2.0) if decays == "moderate" else (0.0, math.inf)
    spec = AttentionSpec(
        MAMBA2, HEADS, HEADS, HEAD_SIZE, 1.0, conv_kernel=KERNEL, state_size=STATE_SIZE, num_groups=GROUPS,
        dt_limit=limit,
    )  # fmt: skip
    backend = make_backend(spec, dtype, path)
    channels = spec.conv_channels
    conv_weight = (0.5 * torch.randn(channels, KERNEL, generator=gen)).to(dtype)
    conv_bias = (0.3 * torch.randn(channels, generator=gen)).to(dtype)
    dt_bias = 0.5 * torch.randn(HEADS, generator=gen) + 0.3
    scale = 0.5 if decays == "moderate" else 40.0
    A = -(scale * torch.rand(HEADS, generator=gen) + 0.05)
    D = torch.randn(HEADS, generator=gen)
    xbc = [torch.randn(n, channels, generator=gen).to(dtype) for n in lengths]
    dt = [torch.randn(n, HEADS, generator=gen).to(dtype) for n in lengths]

    num_slots = len(lengths) + 2
    slots = torch.randperm(num_slots, generator=gen)[: len(lengths)].tolist()
    state = torch.randn(backend.kv_cache_shape(num_slots), generator=gen)  # garbage for fresh sequences
    conv_numel = (KERNEL - 1) * channels
    for b, cached in enumerate(CACHED):  # a continuing sequence's kept inputs are inputs of its dtype
        if cached:
            state[slots[b], :conv_numel] = state[slots[b], :conv_numel].to(dtype).float()
    before = state.clone()

    tables = [[0] * -(-(c + n) // 16) for c, n in zip(CACHED, lengths)]
    common = make_common_metadata(CACHED, lengths, tables, 16, torch.device("cpu"), slots)
    with torch.inference_mode():
        out = backend.forward_mamba2(
            torch.cat(xbc), conv_weight, conv_bias, torch.cat(dt), dt_bias, A, D, state,
            backend.build_metadata(common),
        )  # fmt: skip

    assert out.dtype == torch.float32 and tuple(out.shape) == (sum(lengths), HEADS, HEAD_SIZE)
    atol, rtol = (1e-4, 1e-4) if dtype == torch.float32 else (2e-2, 2e-2)
    others = [s for s in range(num_slots) if s not in slots]
    assert torch.equal(state[others], before[others]), "slots outside the step changed"
    start = 0
    for b, (n, cached) in enumerate(zip(lengths, CACHED)):
        slot = before[slots[b]]
        kept = slot[:conv_numel].view(KERNEL - 1, channels) if cached else torch.zeros(KERNEL - 1, channels)
        ssm = (
            slot[conv_numel:].view(HEADS, HEAD_SIZE, STATE_SIZE)
            if cached
            else torch.zeros(HEADS, HEAD_SIZE, STATE_SIZE)
        )
        y, last, final = naive_scan(spec, kept, ssm, xbc[b], conv_weight, conv_bias, dt[b], dt_bias, A, D)
        label = f"sequence {b} ({n} new tokens, {cached} cached, {path}, {dtype}, {decays} decays)"
        torch.testing.assert_close(
            out[start : start + n], y, atol=atol, rtol=rtol, msg=lambda m, label=label: f"{label}: y\n{m}"
        )
        torch.testing.assert_close(
            state[slots[b], :conv_numel].view(KERNEL - 1, channels), last, atol=0, rtol=0,
            msg=lambda m, label=label: f"{label}: kept convolution inputs\n{m}",
        )  # fmt: skip
        torch.testing.assert_close(
            state[slots[b], conv_numel:].view(HEADS, HEAD_SIZE, STATE_SIZE), final, atol=atol, rtol=rtol,
            msg=lambda m, label=label: f"{label}: S\n{m}",
        )  # fmt: skip
        start += n
