"""``SpecProposerTests``: a speculative-decoding proposer inside the real engine.

The oracle is the target model decoding without speculation. Whatever a proposer
drafts, greedy outputs must be the target's own tokens, and sampled tokens must
follow the target's distribution (a proposer that understates the probability of
its drafts gets them accepted too often: the output leans towards them). Drafts must
respect the contract (one list per request, at most ``num_tokens`` ids in the
vocabulary, probability rows that are distributions giving each draft a chance), each
request's drafts must be its own whatever its place in the batch, and a proposer must
cope with requests whose tokens shrink (rejected drafts, preemption) or that go away:
after a rollback it drafts what a fresh proposer given the same tokens drafts.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, ClassVar

import pytest

from engine.testing.kit.base import KitTests

VOCAB = 320  # the tiny Llama's
SAMPLES = 1200
BINS = 10
# one request's tokens over successive calls: growing, then shrinking, then changing
ROLLBACK_HISTORY = ((9, 4, 7, 1, 9, 4, 7, 1, 9), (9, 4, 7, 1, 9, 4, 7, 1, 9, 4, 7), (9, 4, 7, 1, 9, 4), (9, 4, 8, 8))


class SpecProposerTests(KitTests):
    """Subclass with ``plugin`` and ``proposer_name``; override :meth:`config` for the
    proposer's ``--speculative-config`` (it gets the tiny target checkpoint's directory,
    e.g. to use it as its own draft model). The checks run a tiny random Llama as the
    target, so ``also_load`` defaults to the cpu platform and the llama family.

    ``learns_across_requests``: True for a proposer whose drafts legitimately depend on
    more than the request's tokens (one that learns from other requests' outputs); the
    check that drafts after a rollback equal a fresh proposer's is then skipped."""

    registry_name = "spec_proposers"
    proposer_name: ClassVar[str | None] = None
    also_load: ClassVar[tuple[str, ...]] = ("cpu", "llama")
    learns_across_requests: ClassVar[bool] = False

    def config(self, target: Path) -> dict[str, Any]:
        return {}

    # helpers

    @pytest.fixture(scope="class")
    @classmethod
    def target(cls, tmp_path_factory: pytest.TempPathFactory) -> Path:
        from engine.testing.checkpoints import make_tiny_checkpoint

        path = tmp_path_factory.mktemp("target")
        make_tiny_checkpoint("LlamaForCausalLM", path)
        return path

    def make_llm(self, target: Path, speculative: bool, **kwargs: Any) -> Any:
        from engine import LLM

        if speculative:
            kwargs.update(
                speculative_method=self.required("proposer_name"),
                speculative_config=self.config(target),
                num_speculative_tokens=3,
            )
        plugins = [p for p in (self.required("plugin"), *self.also_load) if p]
        return LLM(str(target), plugins=plugins, dtype="float32", kv_cache_memory=0.05, progress=False, **kwargs)

    def make_proposer(self, target: Path) -> Any:
        import torch

        from engine.interfaces.spec_proposer import ProposerInit
        from engine.selection import select_platform

        components = self.components()
        platform = select_platform(components.platforms, "cpu")
        init = ProposerInit(
            config=self.config(target),
            target_model_path=target,
            vocab_size=VOCAB,
            dtype=torch.float32,
            device=torch.device("cpu"),
            components=components,
            platform=platform,
        )
        return self.resolve(self.required("proposer_name"))(init)

    def check_drafts(self, drafts: Any, num_requests: int, num_tokens: int) -> None:
        from engine.interfaces.spec_proposer import Drafts

        assert isinstance(drafts, Drafts), f"propose returned {type(drafts).__name__}, not Drafts"
        assert len(drafts.token_ids) == num_requests, f"{len(drafts.token_ids)} draft lists for {num_requests} requests"
        for tokens in drafts.token_ids:
            assert len(tokens) <= num_tokens, f"{len(tokens)} drafts where at most {num_tokens} were asked for"
            assert all(isinstance(t, int) and 0 <= t < VOCAB for t in tokens), (
                f"draft ids {tokens} outside [0, {VOCAB})"
            )
        if drafts.probs is not None:
            import torch

            assert len(drafts.probs) == num_requests, f"{len(drafts.probs)} probability tensors for {num_requests}"
            for p, tokens in zip(drafts.probs, drafts.token_ids):
                assert tuple(p.shape) == (len(tokens), VOCAB), (
                    f"draft probabilities shaped {tuple(p.shape)} for {len(tokens)} drafts, expected "
                    f"{(len(tokens), VOCAB)}"
                )
                p = p.double().cpu()
                assert bool(torch.isfinite(p).all()) and bool((p >= 0).all()), "draft probabilities not in [0, inf)"
                sums = p.sum(dim=-1)
                assert torch.allclose(sums, torch.ones_like(sums), atol=1e-3), (
                    f"draft probability rows sum to {[round(x, 4) for x in sums.tolist()]}, not 1"
                )
                chances = p[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)]
                assert bool((chances > 0).all()), (
                    f"drafts {tokens} have probabilities {chances.tolist()} under their own rows: a draft the "
                    f"proposer could not have drawn"
                )

    # checks

    def test_discoverable(self) -> None:
        """The plugin registers the proposer under its declared name (or ``proposer_name`` is its
        ``module.path:Class``), as an engine SpecProposer."""
        from engine.interfaces.spec_proposer import SpecProposer

        cls = self.resolve(self.required("proposer_name"))
        assert isinstance(cls, type) and issubclass(cls, SpecProposer), cls
        self.assert_named(cls, self.proposer_name)

    def test_drafts_follow_the_contract(self, target: Path) -> None:
        """One draft list per request, at most num_tokens ids in the vocabulary; probabilities,
        when given, shaped [len(drafts), vocab], rows summing to 1, each draft with a chance."""
        from engine.interfaces.spec_proposer import DraftRequest

        proposer = self.make_proposer(target)
        rng = random.Random(0)
        requests = [
            DraftRequest("a", tuple(rng.randrange(VOCAB) for _ in range(9))),
            DraftRequest("b", (5, 6, 7, 8) * 6),
            DraftRequest("c", (3,)),
        ]
        for num_tokens in (1, 4):
            hidden = self.hidden_states(proposer, len(requests), target)
            self.check_drafts(proposer.propose(requests, num_tokens, hidden), len(requests), num_tokens)

    def test_copes_with_rollback_and_removal(self, target: Path) -> None:
        """Tokens that shrink or change (rejected drafts, preemption), requests that go
        away and come back: the proposer keeps answering within the contract. ``remove``
        takes ids it never drafted for (a request aborted while waiting) and ids removed
        before."""
        from engine.interfaces.spec_proposer import DraftRequest

        proposer = self.make_proposer(target)
        for tokens in ROLLBACK_HISTORY:
            requests = [DraftRequest("x", tokens), DraftRequest("y", tokens[:3])]
            self.check_drafts(proposer.propose(requests, 3, self.hidden_states(proposer, 2, target)), 2, 3)
        proposer.remove(["x"])
        requests = [DraftRequest("x", (1, 2, 3)), DraftRequest("y", (9, 4, 7, 1))]
        self.check_drafts(proposer.propose(requests, 2, self.hidden_states(proposer, 2, target)), 2, 2)
        proposer.remove(["x", "y"])
        proposer.remove(["x", "never-drafted-for"])

    def test_drafts_belong_to_their_request(self, target: Path) -> None:
        """Each request of a batch gets the drafts it gets alone: drafts are matched to
        requests by position, so a proposer that mixes up its batch (sorts it, reverses
        it) only wastes them, and this is where it shows. Skipped for a proposer whose
        drafts for a repeated call differ (random drafts)."""
        requests = self.distinct_requests()
        alone = self.make_proposer(target)
        hidden = self.hidden_states(alone, len(requests), target, seed=0)
        expected = {}
        for i, request in enumerate(requests):
            row = None if hidden is None else {layer: h[i : i + 1] for layer, h in hidden.items()}
            expected[request.request_id] = list(self.deterministic_drafts(alone, [request], row)[0])
        order = [2, 0, 3, 1]
        batch = [requests[i] for i in order]
        batch_hidden = None if hidden is None else {layer: h[order] for layer, h in hidden.items()}
        got = self.make_proposer(target).propose(batch, 3, batch_hidden)
        self.check_drafts(got, len(batch), 3)
        for request, tokens in zip(batch, got.token_ids):
            assert list(tokens) == expected[request.request_id], (
                f"request {request.request_id!r} drafts {expected[request.request_id]} alone but {list(tokens)} "
                f"in a batch ordered {[r.request_id for r in batch]}: return drafts in the order of the requests"
            )

    def test_drafts_after_rollback_match_a_fresh_proposer(self, target: Path) -> None:
        """After tokens that grew, shrank and changed, a proposer drafts for the request's
        current tokens what a fresh proposer given only those tokens drafts: nothing of a
        rejected draft or a preempted tail is left in its state. Skipped for random drafts,
        for ``learns_across_requests`` and for a proposer reading target hidden states (the
        kit's stand-ins do not follow the tokens)."""
        from engine.interfaces.spec_proposer import DraftRequest

        if self.learns_across_requests:
            pytest.skip("learns_across_requests: drafts may depend on earlier requests")
        proposer = self.make_proposer(target)
        if proposer.hidden_state_layers:
            pytest.skip("the proposer reads target hidden states, which the kit only stands in for")
        for tokens in ROLLBACK_HISTORY[:-1]:
            self.check_drafts(proposer.propose([DraftRequest("x", tokens)], 3), 1, 3)
        final = [DraftRequest("x", ROLLBACK_HISTORY[-1])]
        got = proposer.propose(final, 3)
        self.check_drafts(got, 1, 3)
        fresh = self.deterministic_drafts(self.make_proposer(target), final, None)
        assert list(got.token_ids[0]) == list(fresh[0]), (
            f"after the tokens {list(ROLLBACK_HISTORY)} the proposer drafts {list(got.token_ids[0])} for "
            f"{ROLLBACK_HISTORY[-1]}, a fresh proposer {list(fresh[0])}: state from tokens that were rolled "
            f"back is still used (rebuild what no longer matches the request's tokens)"
        )

    def distinct_requests(self) -> list[Any]:
        """Requests whose continuations differ, so that drafts given to the wrong one show."""
        from engine.interfaces.spec_proposer import DraftRequest

        return [
            DraftRequest("a", (11, 12, 13, 14, 11, 12, 13, 14, 11, 12)),
            DraftRequest("b", (5, 6, 7) * 5),
            DraftRequest("c", (40, 41, 42, 43, 44, 45, 40, 41)),
            DraftRequest("d", (70, 80) * 6 + (70,)),
        ]

    def deterministic_drafts(self, proposer: Any, requests: list[Any], hidden: dict[int, Any] | None) -> list[Any]:
        """``proposer``'s drafts for ``requests``; the check is skipped when the same call twice
        gives other drafts (a proposer that draws them at random)."""
        first = proposer.propose(requests, 3, hidden)
        self.check_drafts(first, len(requests), 3)
        again = proposer.propose(requests, 3, hidden)
        if [list(t) for t in again.token_ids] != [list(t) for t in first.token_ids]:
            pytest.skip("the same call twice gives other drafts: the check needs deterministic drafts")
        return first.token_ids

    def hidden_states(
        self, proposer: Any, num_requests: int, target: Path, seed: int | None = None
    ) -> dict[int, Any] | None:
        """Stand-in target hidden states for a proposer that asks for them: the target's
        ``hidden_size`` wide, or for ``PRE_HEAD_HIDDEN_STATES`` ``hc_mult`` times that (its
        streams, flattened)."""
        import torch

        from engine.interfaces.spec_proposer import PRE_HEAD_HIDDEN_STATES

        if not proposer.hidden_state_layers:
            return None
        config = json.loads((target / "config.json").read_text())
        width = {
            layer: config["hidden_size"] * (config.get("hc_mult", 1) if layer == PRE_HEAD_HIDDEN_STATES else 1)
            for layer in proposer.hidden_state_layers
        }
        gen = None if seed is None else torch.Generator().manual_seed(seed)
        return {layer: torch.randn(num_requests, width[layer], generator=gen) for layer in proposer.hidden_state_layers}

    def test_greedy_output_is_the_target_output(self, target: Path) -> None:
        """A batch of mixed lengths (a repetitive prompt among them) decodes to the
        target's tokens with the proposer on, and the proposer was used."""
        from engine import SamplingParams

        rng = random.Random(1)
        prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (2, 9, 30, 57)]
        prompts.append([21, 22, 23, 24, 25] * 8)
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        expected = [
            o.outputs[0].token_ids for o in self.make_llm(target, False).generate(prompts, params, use_tqdm=False)
        ]
        llm = self.make_llm(target, True)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == expected, "greedy output with speculation differs from the target's"

    def test_sampled_tokens_follow_the_target_distribution(self, target: Path) -> None:
        """1200 samples at temperature 1: the second token (the first a draft can
        supply) is distributed as the target's exact marginal (chi-squared over 10
        groups of tokens of equal probability, p > 0.001)."""
        import torch

        from engine import SamplingParams
        from engine.testing.oracles import chi_squared_p_value, equal_mass_bins

        prompt = [17, 42, 99, 5]
        plain = self.make_llm(target, False)
        (logits,) = plain.prompt_logits([prompt])
        first = logits[-1].double().softmax(-1)
        given = [row[-1].double().softmax(-1) for row in plain.prompt_logits([prompt + [t] for t in range(VOCAB)])]

        second = first @ torch.stack(given)  # P(second) = Σ_t P(first = t) P(second | t)
        llm = self.make_llm(target, True, max_num_seqs=256)
        # three tokens: the second can come from a draft only if a third may follow it
        params = [SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=i) for i in range(SAMPLES)]
        tokens = [o.outputs[0].token_ids[1] for o in llm.generate([prompt] * SAMPLES, params, use_tqdm=False)]
        observed, probabilities = equal_mass_bins(tokens, second, BINS)
        p_value = chi_squared_p_value(observed, probabilities)
        assert p_value > 1e-3, (
            f"the second sampled token is not distributed as the target's (p = {p_value:.2e}): counts in {BINS} "
            f"bins of equal probability {observed}, expected {[round(SAMPLES * p) for p in probabilities]}"
        )
