"""Speculative decoding is lossless: greedy outputs are token-identical to decoding
without it, and sampled outputs follow the target's own distribution, whatever the
proposer drafts."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.interfaces.spec_proposer import Drafts, SpecProposer
from engine.runtime.verify import accept_greedy, accept_sampled
from engine.selection import SelectionError
from engine.spec_decode.budget import SpecBudget, StepCostTable
from engine.spec_decode.ngram import lookup
from engine.testing.oracles import chi_squared_p_value, equal_mass_bins


class RandomProposer(SpecProposer):
    """The worst proposer: uniformly random drafts."""

    name = "random"

    def __init__(self, init):
        super().__init__(init)
        self.rng = random.Random(0)

    def propose(self, requests, num_tokens, hidden_states=None):
        return Drafts([[self.rng.randrange(self.init.vocab_size) for _ in range(num_tokens)] for _ in requests])


class RandomWithProbs(RandomProposer):
    """Random drafts with a random draft distribution each (exercises q in rejection sampling)."""

    name = "random_with_probs"

    def propose(self, requests, num_tokens, hidden_states=None):
        probs = [
            torch.distributions.Dirichlet(torch.full((self.init.vocab_size,), 0.05)).sample((num_tokens,))
            for _ in requests
        ]
        tokens = [torch.multinomial(p, 1).squeeze(1).tolist() for p in probs]
        return Drafts(tokens, probs)


class FinalHiddenProposer(RandomProposer):
    """Asks for the target's final hidden states and checks their shape."""

    name = "final_hidden"
    hidden_state_layers = (-1,)
    seen = 0

    def propose(self, requests, num_tokens, hidden_states=None):
        assert hidden_states[-1].shape[0] == len(requests)
        type(self).seen += 1
        return super().propose(requests, num_tokens)


class PreHeadProposer(RandomProposer):
    """Asks for the hidden states before the head, which only multi-stream targets have."""

    name = "pre_head"
    hidden_state_layers = (-2,)


class LayerThreeProposer(RandomProposer):
    name = "layer_three"
    hidden_state_layers = (3,)


def make_llm(path, **kwargs) -> LLM:
    return LLM(
        str(path),
        **{"plugins": ["cpu", "llama"], "dtype": "float32", "progress": False, "kv_cache_memory": 0.02, **kwargs},
    )


def mixed_prompts(seed: int = 0) -> list[list[int]]:
    """Mixed lengths, two pairs sharing a prefix (prefix-cache hits) and a repetitive one (ngram hits)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randint(2, 70))] for _ in range(8)]
    shared = [rng.randrange(3, 320) for _ in range(40)]
    prompts += [shared + [7, 8], shared + [9], [11, 12, 13, 14, 15] * 9]
    return prompts


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from engine.testing.checkpoints import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("spec")
    make_tiny_checkpoint("LlamaForCausalLM", root / "target")
    make_tiny_checkpoint("LlamaForCausalLM", root / "draft", seed=3, num_hidden_layers=1)
    return root / "target", root / "draft"


@pytest.mark.parametrize(
    "method", ["ngram", "draft-self", "draft-other", "random", "random_with_probs", "final_hidden"]
)
def test_greedy_outputs_are_identical_with_preemption_and_prefix_caching(checkpoints, method):
    target, draft = checkpoints
    speculative = {
        "ngram": ("ngram", {}),
        "draft-self": ("draft", {"model": str(target)}),
        "draft-other": ("draft", {"model": str(draft)}),
        "random": (f"{__name__}:RandomProposer", {}),
        "random_with_probs": (f"{__name__}:RandomWithProbs", {}),
        "final_hidden": (f"{__name__}:FinalHiddenProposer", {}),
    }[method]
    prompts = mixed_prompts()
    params = [
        SamplingParams(temperature=0.0, max_tokens=random.Random(i).randint(20, 60), ignore_eos=True)
        for i in range(len(prompts))
    ]
    # 24 blocks of 16 tokens (2 layers x K,V x 2 kv heads x 16 dims x 4 bytes a token) for 11
    # requests of 455 prompt tokens and up to 60 outputs each: the scheduler must preempt
    options = {"kv_cache_memory": 24 * 16 * (2 * 2 * 2 * 16 * 4) / 2**30, "max_model_len": 256}
    expected = [o.outputs[0].token_ids for o in make_llm(target, **options).generate(prompts, params, use_tqdm=False)]
    llm = make_llm(
        target,
        speculative_method=speculative[0],
        speculative_config=speculative[1],
        num_speculative_tokens=3,
        **options,
    )
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.kv_manager.stats.hits > 0
    spec = llm.engine.spec.stats
    assert spec.rounds > 0 and spec.proposed > 0
    if method == "draft-self":
        assert spec.accepted == spec.proposed  # the target drafting for itself is always right
    if method == "final_hidden":
        assert FinalHiddenProposer.seen > 0


def test_rejection_sampling_keeps_the_target_distribution():
    """accept_sampled's first token is distributed as p[0], for a draft drawn from q."""
    generator = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05], [0.1, 0.1, 0.3, 0.3, 0.2]])
    q = torch.tensor([[0.05, 0.05, 0.1, 0.4, 0.4]])
    counts = [0] * 5
    trials = 20000
    for _ in range(trials):
        draft = int(torch.multinomial(q[0], 1, generator=generator))
        counts[accept_sampled(p, [draft], q, generator)[0]] += 1
    p_value = chi_squared_p_value(counts, p[0].tolist())
    assert p_value > 1e-3, (counts, p_value)
    # no draft probabilities: the draft counts as certain (q one-hot)
    counts = [0] * 5
    for _ in range(trials):
        counts[accept_sampled(p, [3], None, generator)[0]] += 1
    p_value = chi_squared_p_value(counts, p[0].tolist())
    assert p_value > 1e-3, (counts, p_value)


def test_sampled_tokens_follow_the_target_distribution(checkpoints):
    """The first two sampled tokens' marginals with speculation match the target's exact
    ones (from the engine's logits without speculation, over every one-token continuation
    for the second): chi-squared over 10 groups of tokens of equal probability, p > 0.001
    at each position, for 3000 samples."""
    target, _ = checkpoints
    prompt = [17, 42, 99, 5]
    exact = make_llm(target)
    (logits,) = exact.prompt_logits([prompt])
    p1 = logits[-1].softmax(-1).double()
    continuations = [prompt + [t] for t in range(p1.numel())]
    p2_given = torch.stack([row[-1].softmax(-1).double() for row in exact.prompt_logits(continuations)])
    p2 = p1 @ p2_given
    samples = 3000
    for method in (f"{__name__}:RandomWithProbs", "draft"):
        config = {"model": str(target)} if method == "draft" else {}
        llm = make_llm(
            target,
            speculative_method=method,
            speculative_config=config,
            num_speculative_tokens=2,
            max_num_seqs=256,
            kv_cache_memory=0.05,
        )
        outputs = llm.generate(
            [prompt] * samples,
            [SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=i) for i in range(samples)],
            use_tqdm=False,
        )
        tokens = [o.outputs[0].token_ids for o in outputs]
        for position, expected in ((0, p1), (1, p2)):
            observed, probabilities = equal_mass_bins([t[position] for t in tokens], expected, 10)
            p_value = chi_squared_p_value(observed, probabilities)
            assert p_value > 1e-3, (method, position, observed, p_value)
        spec = llm.engine.spec.stats
        assert spec.proposed > 0 and spec.accepted < spec.proposed  # drafts were verified, and rejected too
        if method == "draft":
            assert spec.accepted > 0  # and accepted


def test_greedy_acceptance_and_ngram_lookup_by_hand():
    assert accept_greedy([4, 5, 9], [4, 5]) == [4, 5, 9]
    assert accept_greedy([4, 6, 9], [4, 5]) == [4, 6]
    assert accept_greedy([7, 5, 9], [4, 5]) == [7]
    tokens = np.array([1, 2, 3, 4, 9, 1, 2, 3, 5, 8, 1, 2, 3])
    assert lookup(tokens, 3, 2, 4) == [5, 8, 1]  # the latest earlier "1 2 3" is followed by 5 8 1
    assert lookup(tokens, 3, 4, 4) == []  # "8 1 2 3" occurs nowhere earlier
    assert lookup(np.array([1, 2, 3]), 2, 1, 3) == []


def test_step_cost_table_is_robust_monotone_and_interpolates():
    table = StepCostTable()
    assert table.estimate(4) is None
    for seconds in (1.0, 1.2, 9.0):  # one outlier among three: the median ignores it
        table.record(4, seconds)
    assert table.estimate(4) == pytest.approx(1.2) and table.estimate(2) == pytest.approx(1.2)
    table.record(8, 2.0)
    assert table.estimate(6) == pytest.approx(1.6)  # linear between measured sizes
    assert table.estimate(12) == pytest.approx(2.0)  # beyond them: optimistic, to get measured
    table.record(6, 0.5)  # noise: a larger step measured faster than a smaller one
    assert table.estimate(6) == pytest.approx(1.2)  # costs never fall with more tokens


def test_budget_weighs_every_number_of_drafts():
    """A step cost that jumps at 65 tokens (a kernel's row limit) then grows slowly: one
    draft does not pay, forty do; with low acceptance none do."""
    budget = SpecBudget(max_drafts=1)
    for size in range(60, 130):
        budget.costs.record(size, 0.020 if size <= 64 else 0.024 + 0.00001 * (size - 65))
    ids = [f"r{i}" for i in range(64)]
    for request_id in ids:
        budget.estimate(request_id).acceptance = 0.9
    taken = budget.plan(ids, [[None]] * 64, 64, 64, [1] * 64)
    assert sum(taken) == 64  # 64 + 57.6 expected tokens at 24.6 ms beat 64 at 20 ms
    for request_id in ids:
        budget.estimate(request_id).acceptance = 0.15
    assert sum(budget.plan(ids, [[None]] * 64, 64, 64, [1] * 64)) == 0


def test_random_proposer_falls_back_to_plain_decoding(checkpoints):
    """With drafts that are never accepted, the budget soon stops asking for them: over a
    long generation only a small share of steps carry drafts (the probes)."""
    target, _ = checkpoints
    llm = make_llm(target, speculative_method=f"{__name__}:RandomProposer", num_speculative_tokens=4)
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True), use_tqdm=False)
    spec = llm.engine.spec.stats
    assert spec.accepted <= 2 and spec.rounds <= 200 // 8, (spec.rounds, spec.proposed)


def test_speculation_settings_are_checked(checkpoints):
    target, _ = checkpoints
    with pytest.raises(SelectionError, match="without --speculative-method"):
        make_llm(target, speculative_config={"model": "x"})
    with pytest.raises(ValueError, match="draft needs the draft model"):
        make_llm(target, speculative_method="draft")
    with pytest.raises(ValueError, match="unknown: prompt_lookup"):
        make_llm(target, speculative_method="ngram", speculative_config={"prompt_lookup": 3})
    with pytest.raises(SelectionError, match="before its head, which LlamaForCausalLM does not provide"):
        make_llm(target, speculative_method=f"{__name__}:PreHeadProposer")
    with pytest.raises(ValueError, match=r"hidden states at layers \[3\]"):
        make_llm(target, speculative_method=f"{__name__}:LayerThreeProposer")
