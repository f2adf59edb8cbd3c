"""The Triton Mamba-2 kernels (engine.kernels.mamba2: recurrent and chunked) under the Triton
interpreter, against the torch forms (engine.kernels.mamba2_torch) and, as the triton_mamba2
backend, against the naive recurrence through steps of prefill chunks and decodes."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined: run them on the CPU

import dataclasses  # noqa: E402
import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from test_kernels_mamba2 import check_backend_steps, random_scan_inputs  # noqa: E402

from engine.kernels.mamba2 import TritonMamba2, mamba2_chunked, mamba2_recurrent  # noqa: E402
from engine.kernels.mamba2_torch import chunked  # noqa: E402
from engine.testing.kit import AttentionBackendTests  # noqa: E402


@pytest.mark.parametrize("kernel", ["recurrent", "chunked"])
@pytest.mark.parametrize("heads, head_size, state_size, groups", [(2, 8, 16, 1), (4, 5, 6, 2), (3, 24, 20, 3)])
@pytest.mark.parametrize("lengths", [[1, 1, 1], [5, 40, 1], [16, 17]])
def test_the_kernels_match_the_chunked_torch_form(kernel, heads, head_size, state_size, groups, lengths):
    """Ragged sequences (decode rows, prefill chunks across the 16-row chunk edges), sizes that
    are not powers of two, one to three groups of B and C, from a random initial state: outputs
    and final states within 1e-4, for both kernels."""
    gen = torch.Generator().manual_seed(sum(lengths) * 31 + heads * head_size + state_size)
    x, delta, A, b, c, D, state, valid = random_scan_inputs(
        gen, lengths, heads=heads, head_size=head_size, state_size=state_size, groups=groups
    )
    triton_state = state.clone()
    run = {"recurrent": mamba2_recurrent, "chunked": mamba2_chunked}[kernel]
    y = run(x, delta, A, b, c, D, triton_state, torch.tensor(lengths))
    expected, final = chunked(x, delta, A, b, c, D, state)
    mask = valid[..., None, None]  # rows past a sequence's length are not its tokens
    torch.testing.assert_close(y * mask, expected * mask, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(triton_state, final, atol=1e-4, rtol=1e-4)


def test_the_chunked_kernel_survives_strong_decays():
    """Time steps up to 40 with A down to -2.1: the kernel's exponents are all differences of
    cumulative sums <= 0, so it stays finite and equals the recurrent kernel."""
    gen = torch.Generator().manual_seed(7)
    lengths = [40, 23]
    x, delta, A, b, c, D, state, _ = random_scan_inputs(gen, lengths, heads=2, head_size=8, decay_scale=40.0)
    one, two = state.clone(), state.clone()
    chunked_y = mamba2_chunked(x, delta, A, b, c, D, one, torch.tensor(lengths))
    recurrent_y = mamba2_recurrent(x, delta, A, b, c, D, two, torch.tensor(lengths))
    assert torch.isfinite(chunked_y).all() and torch.isfinite(one).all()
    torch.testing.assert_close(chunked_y, recurrent_y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(one, two, atol=1e-5, rtol=1e-5)


class InterpretedTritonMamba2(TritonMamba2):
    """triton_mamba2 on the CPU, through the Triton interpreter."""

    capabilities = dataclasses.replace(
        TritonMamba2.capabilities, platforms=frozenset({"cpu"}), dtypes=frozenset({"float32"})
    )


@pytest.mark.parametrize("with_bias, dt_limit", [(True, (0.0, math.inf)), (False, (0.05, 0.8))])
def test_triton_mamba2_serves_steps_of_prefill_chunks_and_decodes(with_bias, dt_limit):
    check_backend_steps(InterpretedTritonMamba2, torch.float32, with_bias, dt_limit)


class TestTritonMamba2Kit(AttentionBackendTests):
    """The kit's checks of triton_mamba2 (registered by the engine itself), run through the
    interpreter: test_mamba2 and test_mamba2_state against the token-by-token oracle."""

    plugin = "cpu"
    backend_name = "triton_mamba2"
    dtypes = ("float32",)

    def backend_class(self):
        return InterpretedTritonMamba2
