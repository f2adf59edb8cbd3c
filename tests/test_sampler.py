"""The sampler against hand-computed and naive references."""

from __future__ import annotations

import torch

from engine.interfaces.ops import LayerOps
from engine.runtime.request import Request
from engine.runtime.sampler import Sampler, apply_min_p, apply_penalties, apply_top_k_top_p, pad_token_ids
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
    tokens = Sampler(torch.device("cpu"))(logits, [make_request(i, temperature=0.0) for i in range(5)]).token_ids
    assert tokens.tolist() == logits.argmax(-1).tolist()


class CountingOps(LayerOps):
    def __init__(self) -> None:
        self.argmax_dtypes: list[torch.dtype] = []

    def argmax(self, logits):
        self.argmax_dtypes.append(logits.dtype)
        return super().argmax(logits)


def test_plain_greedy_batches_take_ops_argmax_on_the_model_dtype():
    """Greedy with nothing else to do: the platform's argmax on the bf16 logits, no fp32 copy;
    logprobs, penalties or a pending min_tokens take the fp32 path."""
    ops = CountingOps()
    sampler = Sampler(torch.device("cpu"), ops)
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(2)).bfloat16()
    greedy = [make_request(i, temperature=0.0) for i in range(3)]
    assert sampler(logits, greedy).token_ids.tolist() == logits.float().argmax(-1).tolist()
    assert ops.argmax_dtypes == [torch.bfloat16]
    for extra in ({"logprobs": 1}, {"repetition_penalty": 1.2}, {"min_tokens": 1}):
        requests = [make_request(0, temperature=0.0, **extra)]
        sampler(logits[:1], requests)
        assert ops.argmax_dtypes == [torch.bfloat16], extra
    # min_tokens already reached: plain greedy again
    done = make_request(0, temperature=0.0, min_tokens=1)
    done.append_token(5)
    assert done.num_output_tokens == 1
    sampler(logits[:1], [done])
    assert ops.argmax_dtypes == [torch.bfloat16, torch.bfloat16]


def test_sampling_follows_the_tempered_distribution():
    logits = torch.tensor([1.0, 2.0, 0.0, 3.0])
    temperature = 2.0
    n = 40000
    requests = [make_request(i, temperature=temperature) for i in range(n)]
    torch.manual_seed(0)
    tokens = Sampler(torch.device("cpu"))(logits.expand(n, 4).clone(), requests).token_ids
    freq = torch.bincount(tokens, minlength=4).float() / n
    expected = (logits / temperature).softmax(0)
    assert (freq - expected).abs().max().item() < 0.01


def test_top_k_sampling_never_leaves_the_top_k():
    logits = torch.randn(2000, 20, generator=torch.Generator().manual_seed(2))
    requests = [make_request(i, temperature=1.0, top_k=3) for i in range(2000)]
    tokens = Sampler(torch.device("cpu"))(logits, requests).token_ids
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
            tokens = sampler(logits[batch_rows], requests).token_ids
            out.append(int(tokens[seeded_row]))
        return out

    alone = run([0], 0)
    # the seeded request's logits are always row 0 of each step; put it at other batch positions
    assert run([1, 0, 2], 1) == alone
    assert run([2, 1, 0], 2) == alone


# penalties, min-p, min_tokens, logprobs


def with_history(i: int, prompt: list[int], output: list[int], **params) -> Request:
    request = Request(f"h{i}", prompt, SamplingParams(**params), eos_token_ids=frozenset({0}))
    for token in output:
        request.append_token(token)
    return request


def reference_penalties(
    row: list[float], prompt: list[int], output: list[int], rep: float, pres: float, freq: float
) -> list[float]:
    """The formulas as written: HF/vLLM repetition over prompt + output, OpenAI presence/frequency over output."""
    out = []
    for token, logit in enumerate(row):
        if token in prompt or token in output:
            logit = logit / rep if logit > 0 else logit * rep
        count = output.count(token)
        logit -= pres * (1 if count > 0 else 0) + freq * count
        out.append(logit)
    return out


def test_penalties_hand_computed():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    # token 0 in the prompt, token 1 twice and token 3 once in the output, token 2 unseen
    out = apply_penalties(
        logits,
        torch.tensor([[0, 4]]),
        torch.tensor([[1, 1, 3]]),
        torch.tensor([2.0]),
        torch.tensor([0.5]),
        torch.tensor([0.25]),
    )
    # 2/2; -1*2 - 0.5 - 2*0.25; 0.5; 3/2 - 0.5 - 0.25
    assert out.tolist() == [[1.0, -3.0, 0.5, 0.75]]


def test_penalties_match_the_reference_formula():
    gen = torch.Generator().manual_seed(4)
    vocab, rows = 40, 12
    logits = torch.randn(rows, vocab, generator=gen) * 3
    histories = []
    for _ in range(rows):
        prompt = torch.randint(0, vocab, (int(torch.randint(1, 10, (1,), generator=gen)),), generator=gen).tolist()
        output = torch.randint(0, vocab, (int(torch.randint(0, 15, (1,), generator=gen)),), generator=gen).tolist()
        rep, pres, freq = (
            torch.rand(3, generator=gen) * torch.tensor([2.0, 4.0, 4.0]) + torch.tensor([0.1, -2, -2])
        ).tolist()
        histories.append((prompt, output, rep, pres, freq))
    expected = torch.tensor([reference_penalties(logits[i].tolist(), *h) for i, h in enumerate(histories)])
    pad = lambda lists: pad_token_ids(lists, vocab, torch.device("cpu"))  # noqa: E731
    out = apply_penalties(
        logits,
        pad([h[0] for h in histories]),
        pad([h[1] for h in histories]),
        torch.tensor([h[2] for h in histories]),
        torch.tensor([h[3] for h in histories]),
        torch.tensor([h[4] for h in histories]),
    )
    assert torch.allclose(out, expected, atol=1e-5)
    # through the sampler: greedy picks the argmax of the penalised logits; rows without penalties are untouched
    requests = [
        with_history(i, p, o, temperature=0.0, repetition_penalty=r, presence_penalty=pr, frequency_penalty=f)
        if i % 3
        else with_history(i, p, o, temperature=0.0)
        for i, (p, o, r, pr, f) in enumerate(histories)
    ]
    tokens = Sampler(torch.device("cpu"))(logits, requests).token_ids
    reference = torch.where(torch.tensor([i % 3 != 0 for i in range(rows)]).unsqueeze(1), expected, logits)
    assert tokens.tolist() == reference.argmax(-1).tolist()
    assert tokens.tolist() != logits.argmax(-1).tolist()  # the penalties did change some choices


def test_min_p_keeps_exactly_the_tokens_above_the_threshold():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(20, 60, generator=gen) * 2
    min_p = torch.rand(20, generator=gen)
    out = apply_min_p(logits, min_p)
    for i in range(20):
        probs = logits[i].softmax(0).tolist()
        keep = [p >= float(min_p[i]) * max(probs) for p in probs]
        assert torch.isfinite(out[i]).tolist() == keep
        assert torch.equal(out[i][torch.isfinite(out[i])], logits[i][torch.tensor(keep)])


def test_min_p_sampling_never_leaves_the_kept_set():
    logits = torch.randn(2000, 20, generator=torch.Generator().manual_seed(6)) * 2
    requests = [make_request(i, temperature=1.0, min_p=0.3) for i in range(2000)]
    tokens = Sampler(torch.device("cpu"))(logits, requests).token_ids
    probs = logits.softmax(-1)
    chosen = probs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    assert (chosen >= 0.3 * probs.max(-1).values).all()


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]] * 4)  # eos 0 is the argmax, then stop token 1
    sampler = Sampler(torch.device("cpu"))
    requests = [
        with_history(0, [3], [3], temperature=0.0, min_tokens=2, stop_token_ids=[1]),  # 1 output < 2: masked
        with_history(1, [3], [3, 3], temperature=0.0, min_tokens=2, stop_token_ids=[1]),  # reached: eos allowed
        with_history(2, [3], [3], temperature=0.0, min_tokens=2, ignore_eos=True),  # eos is no stop: allowed
        with_history(3, [3], [], temperature=0.0, min_tokens=1),
    ]
    assert sampler(logits, requests).token_ids.tolist() == [2, 0, 0, 1]


def test_logprobs_are_of_the_raw_distribution_with_ranks_and_top_n():
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(6, 50, generator=gen) * 2
    original = logits.clone()
    requests = [
        with_history(
            0, [1, 2], [3, 3], temperature=0.7, top_k=5, repetition_penalty=1.5, presence_penalty=1.0, logprobs=3
        ),
        with_history(1, [4], [], temperature=0.0, logprobs=0),
        with_history(2, [4], [], temperature=1.0, min_p=0.2, seed=3, logprobs=5),
        with_history(3, [4], [], temperature=1.0),
        with_history(4, [4], [], temperature=0.0, frequency_penalty=2.0, logprobs=50),
        with_history(5, [4], [], temperature=2.0, top_p=0.5, logprobs=1),
    ]
    out = Sampler(torch.device("cpu"))(logits, requests)
    assert torch.equal(logits, original)  # the caller's logits are not modified
    reference = original.log_softmax(-1)
    assert out.logprobs is not None
    entries = out.logprobs.entries([r.sampling_params.logprobs for r in requests])
    assert entries[3] is None
    for i, entry in enumerate(entries):
        if entry is None:
            continue
        n = requests[i].sampling_params.logprobs
        token = int(out.token_ids[i])
        assert entry.token_ids[0] == token
        assert abs(entry.logprobs[0] - float(reference[i, token])) < 1e-6
        assert entry.rank == 1 + int((reference[i] > reference[i, token]).sum())
        assert entry.token_ids[1:] == reference[i].argsort(descending=True)[:n].tolist()
        assert torch.allclose(torch.tensor(entry.logprobs[1:]), reference[i].sort(descending=True).values[:n])


def test_seeded_requests_with_penalties_and_min_p_do_not_depend_on_the_batch():
    vocab = 64
    gen = torch.Generator().manual_seed(8)
    step_logits = [torch.randn(vocab, generator=gen) * 2 for _ in range(12)]
    seeded_params = dict(
        temperature=0.8,
        seed=7,
        min_p=0.05,
        top_k=30,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=0.3,
    )

    def run(num_others: int, position: int) -> list[int]:
        sampler = Sampler(torch.device("cpu"))
        seeded = with_history(0, [5, 6, 7], [], **seeded_params)
        others = [with_history(i + 1, [i + 1], [], temperature=1.0, presence_penalty=1.0) for i in range(num_others)]
        requests = others[:position] + [seeded] + others[position:]
        for logits in step_logits:
            batch = torch.stack([logits if r is seeded else torch.randn(vocab, generator=gen) for r in requests])
            tokens = sampler(batch, requests).token_ids.tolist()
            for request, token in zip(requests, tokens):
                request.append_token(token)
        return seeded.output_token_ids

    alone = run(0, 0)
    assert run(3, 1) == alone
    assert run(5, 5) == alone
