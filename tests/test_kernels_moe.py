"""The Triton grouped expert GEMM (engine.kernels.moe) under the Triton interpreter, against the
engine's torch experts (engine.layers.moe.Experts: a matmul pair per expert)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined: run them on the CPU

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from engine.interfaces.forward_context import ForwardContext  # noqa: E402
from engine.kernels.moe import fused_moe, sort_by_expert  # noqa: E402
from engine.layers.moe import Experts, clamped_swiglu  # noqa: E402


def test_sorting_groups_pairs_by_expert_in_whole_tiles():
    expert_ids = torch.tensor([[2, 0], [2, 1], [0, 2]])
    pairs, tile_expert = sort_by_expert(expert_ids, 4, 4)
    assert tile_expert.tolist() == [0, 1, 2]  # expert 3 has no pair and no tile
    assert pairs.tolist() == [1, 4, -1, -1, 3, -1, -1, -1, 0, 2, 5, -1]


@pytest.mark.parametrize(
    "tokens, experts, top_k, hidden, inter", [(1, 4, 2, 32, 16), (13, 8, 2, 48, 40), (37, 5, 3, 64, 24)]
)
@pytest.mark.parametrize("limit", [None, 1.0])
def test_fused_moe_matches_the_per_expert_torch_experts(tokens, experts, top_k, hidden, inter, limit):
    """Ragged loads (some experts unused), hidden and intermediate sizes off the tile sizes, the
    default SiLU-and-multiply and a clamped SwiGLU: within 1e-4 of engine.layers.moe.Experts."""
    gen = torch.Generator().manual_seed(tokens * 7 + experts)
    module = Experts(experts, inter, hidden, torch.float32, swiglu_limit=limit)
    with torch.no_grad():
        module.w13.copy_(torch.randn(module.w13.shape, generator=gen) / hidden**0.5)
        module.w2.copy_(torch.randn(module.w2.shape, generator=gen) / inter**0.5)
    x = torch.randn(tokens, hidden, generator=gen)
    expert_ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    ctx = ForwardContext(backends=[], kv_caches=[], metadata=[])
    expected = module(x, expert_ids, weights, ctx)
    activation = None if limit is None else (lambda gate_up: clamped_swiglu(gate_up, limit))
    got = fused_moe(x, module.w13, module.w2, expert_ids, weights, activation)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
