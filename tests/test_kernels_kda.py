"""The Triton KDA kernels (engine.kernels.kda: recurrent and chunked) under the Triton
interpreter, against the torch forms (engine.kernels.kda_torch) and, as the triton_kda backend,
through the attention kit's linear-attention check."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined: run them on the CPU

import dataclasses  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from engine.kernels.kda import TritonKdaAttention, kda_chunked, kda_recurrent  # noqa: E402
from engine.kernels.kda_torch import chunked, l2_normalize, recurrent_step  # noqa: E402
from engine.testing.kit import AttentionBackendTests  # noqa: E402


def random_inputs(gen, num_seqs, rows, heads, dk, dv):
    q = l2_normalize(torch.randn(num_seqs, rows, heads, dk, generator=gen)) * dk**-0.5
    k = l2_normalize(torch.randn(num_seqs, rows, heads, dk, generator=gen))
    v = torch.randn(num_seqs, rows, heads, dv, generator=gen)
    g = -0.5 * torch.randn(num_seqs, rows, heads, dk, generator=gen).exp()
    beta = torch.rand(num_seqs, rows, heads, generator=gen)
    state = torch.randn(num_seqs, heads, dk, dv, generator=gen)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("kernel", ["recurrent", "chunked"])
@pytest.mark.parametrize("heads, dk, dv", [(1, 8, 8), (3, 16, 12), (2, 24, 32)])
@pytest.mark.parametrize("lengths", [[1, 1, 1], [5, 70, 1], [64, 3]])
def test_the_kernels_match_the_chunked_and_recurrent_torch_forms(kernel, heads, dk, dv, lengths):
    """Ragged sequences (decode rows, prefill chunks across the 16- and 64-token chunk edges),
    head sizes that are not powers of two, from a random initial state: outputs and final states
    within 1e-4, for both Triton kernels."""
    gen = torch.Generator().manual_seed(sum(lengths) * 31 + heads * dk + dv)
    rows = max(lengths)
    q, k, v, g, beta, state = random_inputs(gen, len(lengths), rows, heads, dk, dv)
    valid = (torch.arange(rows)[None, :] < torch.tensor(lengths)[:, None])[..., None]  # padding: k = β = g = 0
    k, g, beta = k * valid[..., None], g * valid[..., None], beta * valid
    lengths_t = torch.tensor(lengths)
    triton_state = state.clone()
    out = {"recurrent": kda_recurrent, "chunked": kda_chunked}[kernel](q, k, v, g, beta, triton_state, lengths_t)
    if rows == 1:
        expected, final = recurrent_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state)
        expected = expected.unsqueeze(1)
    else:
        expected, final = chunked(q, k, v, g, beta, state)
    expected = expected * valid[..., None]  # rows past a sequence's length are not its tokens
    torch.testing.assert_close(out * valid[..., None], expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(triton_state, final, atol=1e-4, rtol=1e-4)


def test_the_chunked_kernel_survives_strong_decays():
    """Log decays of -60 a token (cumulative -960 over a chunk): the chunked kernel takes decays
    from differences within the chunk, never e^{-c}, so it stays finite and equals the recurrent."""
    gen = torch.Generator().manual_seed(7)
    q, k, v, g, beta, state = random_inputs(gen, 2, 40, 2, 16, 16)
    g = g.clamp(max=0) - 60.0
    lengths = torch.tensor([40, 23])
    a, b = state.clone(), state.clone()
    chunked_out = kda_chunked(q, k, v, g, beta, a, lengths)
    recurrent_out = kda_recurrent(q, k, v, g, beta, b, lengths)
    assert torch.isfinite(chunked_out).all() and torch.isfinite(a).all()
    torch.testing.assert_close(chunked_out, recurrent_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


class InterpretedTritonKda(TritonKdaAttention):
    """triton_kda on the CPU, through the Triton interpreter."""

    capabilities = dataclasses.replace(
        TritonKdaAttention.capabilities, platforms=frozenset({"cpu"}), dtypes=frozenset({"float32"})
    )


class TestTritonKdaKit(AttentionBackendTests):
    """The kit's checks of triton_kda (registered by the engine itself), run through the
    interpreter: test_linear against the token-by-token oracle."""

    plugin = "cpu"
    backend_name = "triton_kda"
    dtypes = ("float32",)

    def backend_class(self):
        return InterpretedTritonKda
