"""The torch chunked form of the delta rule (engine.kernels.kda_torch.chunked) against its
token-by-token recurrence: with one gate per channel (Kimi delta attention) and with one
gate per head (gated DeltaNet, which takes ``chunked_head_gates``)."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import kda_torch
from engine.kernels.kda_torch import chunked, l2_normalize, recurrent_step


def inputs(seed: int, num_seqs: int, rows: int, heads: int, dk: int, dv: int, head_gates: bool, scale: float = 0.5):
    gen = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(num_seqs, rows, heads, dk, generator=gen)) * dk**-0.5
    k = l2_normalize(torch.randn(num_seqs, rows, heads, dk, generator=gen))
    v = torch.randn(num_seqs, rows, heads, dv, generator=gen)
    width = 1 if head_gates else dk
    g = (-scale * torch.randn(num_seqs, rows, heads, width, generator=gen).exp()).expand(-1, -1, -1, dk)
    beta = torch.rand(num_seqs, rows, heads, generator=gen)
    state = torch.randn(num_seqs, heads, dk, dv, generator=gen)
    return q, k, v, g.contiguous(), beta, state


def recurrence(q, k, v, g, beta, state):
    outs = []
    for t in range(q.shape[1]):
        o, state = recurrent_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        outs.append(o)
    return torch.stack(outs, 1), state


@pytest.mark.parametrize("head_gates", [False, True])
@pytest.mark.parametrize("rows, heads, dk, dv", [(5, 1, 8, 8), (64, 3, 16, 12), (150, 2, 24, 32)])
def test_chunked_equals_the_recurrence(head_gates, rows, heads, dk, dv, monkeypatch):
    """Within 1e-5, outputs and final states, across one, two and three 64-token chunks (the
    last ones padded); one gate per head goes through chunked_head_gates, one per channel does not."""
    calls = []
    original = kda_torch.chunked_head_gates
    monkeypatch.setattr(kda_torch, "chunked_head_gates", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    q, k, v, g, beta, state = inputs(rows * 7 + dk, 2, rows, heads, dk, dv, head_gates)
    out, final = chunked(q, k, v, g, beta, state)
    expected, expected_final = recurrence(q, k, v, g, beta, state)
    assert bool(calls) == head_gates
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, expected_final, atol=1e-5, rtol=1e-5)


def test_head_gates_with_padding_rows_and_strong_decays():
    """Padding rows (k = β = g = 0) leave the state as it was; log decays of -30 a token stay finite."""
    q, k, v, g, beta, state = inputs(3, 2, 70, 2, 16, 16, head_gates=True)
    g = g - 30.0
    lengths = torch.tensor([70, 23])
    valid = (torch.arange(70)[None, :] < lengths[:, None])[..., None]
    k, g, beta = k * valid[..., None], g * valid[..., None], beta * valid
    out, final = chunked(q, k, v, g, beta, state)
    expected, expected_final = recurrence(q, k, v, g, beta, state)
    assert torch.isfinite(out).all() and torch.isfinite(final).all()
    torch.testing.assert_close(out * valid[..., None], expected * valid[..., None], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, expected_final, atol=1e-5, rtol=1e-5)
