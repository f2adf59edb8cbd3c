"""engine-cpu's fused layer ops against the torch reference in engine.interfaces.ops."""

from __future__ import annotations

import pytest
import torch

from engine.interfaces.ops import REFERENCE_OPS
from engine_cpu import native
from engine_cpu.ops import NativeLayerOps


@pytest.fixture(scope="module")
def ops(each_isa):
    return NativeLayerOps(native.load())


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dtype == torch.bfloat16:
        # the same roundings in the same order; only the fp32 sum of squares may differ in its last bit
        mismatch = (a != b).float().mean().item()
        assert mismatch < 0.002, mismatch
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-2)
    else:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm(ops, dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 96, generator=gen) * 4).to(dtype)
    w = torch.randn(96, generator=gen).to(dtype)
    close(ops.rms_norm(x, w, 1e-6), REFERENCE_OPS.rms_norm(x, w, 1e-6))
    # per-head norm on a [T, H, D] view, as Qwen3's q/k norms do
    x3 = x.view(rows, 3, 32)
    close(ops.rms_norm(x3, w[:32], 1e-6), REFERENCE_OPS.rms_norm(x3, w[:32], 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm(ops, dtype):
    gen = torch.Generator().manual_seed(1)
    x, residual = (torch.randn(33, 64, generator=gen).to(dtype) for _ in range(2))
    w = torch.randn(64, generator=gen).to(dtype)
    expected_out, expected_residual = REFERENCE_OPS.add_rms_norm(x.clone(), residual.clone(), w, 1e-5)
    out, new_residual = ops.add_rms_norm(x.clone(), residual.clone(), w, 1e-5)
    close(new_residual, expected_residual)
    close(out, expected_out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_rotary_on_strided_views(ops, dtype, rotary_dim):
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(9, 6 * 64, generator=gen).to(dtype)
    q, k, _ = qkv.split([4 * 64, 64, 64], dim=-1)  # views with a token stride of the whole row
    q, k = q.view(9, 4, 64), k.view(9, 1, 64)
    angles = torch.rand(9, rotary_dim // 2, generator=gen) * 6
    cos, sin = (torch.cat((f(angles), f(angles)), -1).to(dtype) for f in (torch.cos, torch.sin))
    expected_q, expected_k = REFERENCE_OPS.rotary(q.clone(), k.clone(), cos, sin)
    out_q, out_k = ops.rotary(q, k, cos, sin)
    close(out_q, expected_q)
    close(out_k, expected_k)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(ops, dtype):
    x = (torch.randn(17, 2 * 40, generator=torch.Generator().manual_seed(3)) * 3).to(dtype)
    close(ops.silu_and_mul(x), REFERENCE_OPS.silu_and_mul(x))


def test_other_dtypes_fall_back_to_the_reference(ops):
    x = torch.randn(4, 16, dtype=torch.float16)
    w = torch.ones(16, dtype=torch.float16)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), REFERENCE_OPS.rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,vocab", [(1, 5), (3, 16), (7, 37), (67, 32000), (2, 1)])
def test_argmax_matches_torch(ops, dtype, rows, vocab):
    """First index of the maximum, ties included (bf16 rounding makes many), as torch.argmax."""
    gen = torch.Generator().manual_seed(rows * vocab)
    logits = (torch.randn(rows, vocab, generator=gen) * 3).round().to(dtype)  # many exact ties
    assert torch.equal(ops.argmax(logits), logits.argmax(dim=-1))
    logits[:, -1] = 100  # the maximum in the tail, past the last whole vector
    assert torch.equal(ops.argmax(logits), logits.argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_nan_and_infinities_as_torch(ops, dtype):
    logits = torch.zeros(5, 40, dtype=dtype)
    logits[0, 33] = float("nan")  # NaN in the tail counts as the maximum
    logits[0, 3] = float("inf")
    logits[1, 20] = float("nan")  # NaN in the vector part, two of them
    logits[1, 25] = float("nan")
    logits[2] = float("-inf")  # all -inf: index 0
    logits[3, 17] = float("inf")
    logits[3, 18] = float("inf")
    logits[4, 0] = float("nan")
    assert ops.argmax(logits).tolist() == logits.argmax(dim=-1).tolist() == [33, 20, 0, 17, 0]


def naive_masked(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The bitmask's definition, bit by bit: token t of row j is kept iff bit t % 32 of word t // 32 is set."""
    out = logits.clone()
    words = bitmask.tolist()
    for j, row in enumerate(rows):
        for t in range(logits.shape[1]):
            if not (words[j][t // 32] >> (t % 32)) & 1:
                out[row, t] = float("-inf")
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows,vocab", [(1, 5), (3, 32), (4, 77), (6, 333)])
def test_apply_token_bitmask_matches_the_bit_definition(ops, dtype, num_rows, vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(num_rows + 2, vocab, generator=gen).to(dtype)
    words = (vocab + 31) // 32 + 1  # wider than needed, as masks of a larger vocabulary are
    bitmask = torch.randint(-(2**31), 2**31 - 1, (num_rows, words), generator=gen, dtype=torch.int32)
    bitmask[0] = 0  # nothing allowed
    if num_rows > 1:
        bitmask[1] = -1  # everything allowed
    rows = torch.randperm(num_rows + 2, generator=gen)[:num_rows]
    expected = naive_masked(logits, bitmask, rows.tolist())
    native_out, reference_out = logits.clone(), logits.clone()
    ops.apply_token_bitmask(native_out, bitmask, rows)
    REFERENCE_OPS.apply_token_bitmask(reference_out, bitmask, rows)
    assert torch.equal(native_out, expected) and torch.equal(reference_out, expected)


def test_apply_token_bitmask_large_vocabulary(ops):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 32000, generator=gen).to(torch.bfloat16)
    bitmask = torch.zeros(64, 1000, dtype=torch.int32)
    bitmask[:, :3] = torch.randint(-(2**31), 2**31 - 1, (64, 3), generator=gen, dtype=torch.int32)
    bitmask[5] = -1
    rows = torch.arange(64)
    native_out, reference_out = logits.clone(), logits.clone()
    ops.apply_token_bitmask(native_out, bitmask, rows)
    REFERENCE_OPS.apply_token_bitmask(reference_out, bitmask, rows)
    assert torch.equal(native_out, reference_out)
    assert torch.equal(native_out[5], logits[5]) and torch.isinf(native_out[0, 96:]).all()
