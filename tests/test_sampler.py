"""The sampler against hand-computed and naive references."""

from __future__ import annotations

import torch

from engine.runtime.request import Request
from engine.runtime.sampler import Sampler, apply_top_k_top_p
from engine.sampling_params import SamplingParams


def make_request(i: int, **params) -> Request:
    return Request(f"r{i}", [1, 2, 3], SamplingParams(**params))


def naive_filter(row: torch.Tensor, k: int, p: float) -> torch.Tensor:
    """Keep the top-k tokens, then the smallest prefix of them (by prob) reaching p."""
    order = row.argsort(descending=True).tolist()
    kept = order[:k]
    probs = row[kept].softmax(0).tolist()
    keep, mass = [], 0.0
    for token, prob in zip(kept, probs):
        if mass >= p:
            break
        keep.append(token)
        mass += prob
    out = torch.full_like(row, float("-inf"))
    out[keep] = row[keep]
    return out


def test_top_k_top_p_hand_computed():
    # probabilities 0.5, 0.25, 0.125, 0.125
    logits = torch.log(torch.tensor([[0.125, 0.5, 0.125, 0.25]]))
    kept = apply_top_k_top_p(logits, None, torch.tensor([0.7]))
    assert torch.isfinite(kept).tolist() == [[False, True, False, True]]  # 0.5 < 0.7 needs 0.25 too
    kept = apply_top_k_top_p(logits, None, torch.tensor([0.5]))
    assert torch.isfinite(kept).tolist() == [[False, True, False, False]]  # 0.5 alone reaches 0.5
    kept = apply_top_k_top_p(logits, torch.tensor([1]), None)
    assert torch.isfinite(kept).tolist() == [[False, True, False, False]]


def test_top_k_top_p_matches_naive_reference():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 50, generator=gen) * 3
    top_k = torch.randint(1, 51, (16,), generator=gen)
    top_p = torch.rand(16, generator=gen) * 0.9 + 0.05
    out = apply_top_k_top_p(logits, top_k, top_p)
    for i in range(16):
        expected = naive_filter(logits[i], int(top_k[i]), float(top_p[i]))
        assert torch.equal(torch.isfinite(out[i]), torch.isfinite(expected))
        assert torch.equal(out[i][torch.isfinite(out[i])], expected[torch.isfinite(expected)])


def test_greedy_is_argmax():
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(1))
    tokens = Sampler(torch.device("cpu"))(logits, [make_request(i, temperature=0.0) for i in range(5)])
    assert tokens.tolist() == logits.argmax(-1).tolist()


def test_sampling_follows_the_tempered_distribution():
    logits = torch.tensor([1.0, 2.0, 0.0, 3.0])
    temperature = 2.0
    n = 40000
    requests = [make_request(i, temperature=temperature) for i in range(n)]
    torch.manual_seed(0)
    tokens = Sampler(torch.device("cpu"))(logits.expand(n, 4).clone(), requests)
    freq = torch.bincount(tokens, minlength=4).float() / n
    expected = (logits / temperature).softmax(0)
    assert (freq - expected).abs().max().item() < 0.01


def test_top_k_sampling_never_leaves_the_top_k():
    logits = torch.randn(2000, 20, generator=torch.Generator().manual_seed(2))
    requests = [make_request(i, temperature=1.0, top_k=3) for i in range(2000)]
    tokens = Sampler(torch.device("cpu"))(logits, requests)
    top3 = logits.topk(3, dim=-1).indices
    assert (top3 == tokens.unsqueeze(1)).any(dim=1).all()


def test_seeded_requests_do_not_depend_on_the_batch():
    sampler = Sampler(torch.device("cpu"))
    gen = torch.Generator().manual_seed(3)
    steps = [torch.randn(3, 100, generator=gen) for _ in range(5)]

    def run(batch_rows: list[int], seeded_row: int) -> list[int]:
        seeded = make_request(0, temperature=1.0, seed=42)
        others = [make_request(i + 1, temperature=1.0) for i in range(len(batch_rows) - 1)]
        out = []
        for logits in steps:
            requests = others[:seeded_row] + [seeded] + others[seeded_row:]
            tokens = sampler(logits[batch_rows], requests)
            out.append(int(tokens[seeded_row]))
        return out

    alone = run([0], 0)
    # the seeded request's logits are always row 0 of each step; put it at other batch positions
    assert run([1, 0, 2], 1) == alone
    assert run([2, 1, 0], 2) == alone
