"""The engine's side of speculative decoding: which requests get drafts this step,
how many each gets, and what verification kept (the scheduler allocates their blocks)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from engine.interfaces.spec_proposer import (
    FINAL_HIDDEN_STATES,
    PRE_HEAD_HIDDEN_STATES,
    DraftRequest,
    Drafts,
    SpecProposer,
)
from engine.runtime.batch import ScheduledBatch
from engine.runtime.request import Request
from engine.spec_decode.budget import SpecBudget

logger = logging.getLogger("engine.spec_decode")


@dataclass
class SpecDecodeStats:
    """Counters since start: draft rounds (a request verified with ≥ 1 draft), drafts
    proposed and accepted, and per draft position how many were verified / accepted."""

    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    proposed_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a draft round produced on average: accepted drafts plus the one the target adds."""
        return 1 + self.accepted / self.rounds if self.rounds else 0.0

    def acceptance_by_position(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted_at, self.proposed_at)]

    def record(self, proposed: int, accepted: int) -> None:
        grow = proposed - len(self.proposed_at)
        if grow > 0:
            self.proposed_at += [0] * grow
            self.accepted_at += [0] * grow
        self.rounds += 1
        self.proposed += proposed
        self.accepted += accepted
        for position in range(proposed):
            self.proposed_at[position] += 1
            self.accepted_at[position] += position < accepted


def can_speculate(request: Request) -> bool:
    """Requests whose sampling the verifier reproduces exactly: not logprobs, penalties
    (they change with every accepted token) or a pending ``min_tokens``."""
    params = request.sampling_params
    pending_min = params.min_tokens and request.num_output_tokens < params.min_tokens
    return params.logprobs is None and not params.has_penalties and not pending_min


class SpecDecoder:
    """Which decoding requests get drafts and how many (the adaptive budget), what the
    proposer drafted, and what verification kept. The scheduler asks it for drafts while
    it schedules and allocates their KV blocks itself; ``hidden_states`` is the runner's
    map of each request's newest hidden state, for proposers that read them."""

    def __init__(
        self,
        proposer: SpecProposer,
        num_speculative_tokens: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        vocab_size: int,
        hidden_states: dict[str, torch.Tensor] | None = None,
    ) -> None:
        layers = tuple(proposer.hidden_state_layers)
        if layers not in ((), (FINAL_HIDDEN_STATES,), (PRE_HEAD_HIDDEN_STATES,)):
            raise ValueError(
                f"Proposer {proposer.name!r} asks for the target's hidden states at layers {list(layers)}; the "
                f"engine provides the final hidden states ({FINAL_HIDDEN_STATES}) or those before the head "
                f"({PRE_HEAD_HIDDEN_STATES}), one of them."
            )
        self.proposer = proposer
        self.num_speculative_tokens = num_speculative_tokens
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.hidden_states = hidden_states if hidden_states is not None else {}
        self.budget = SpecBudget(num_speculative_tokens)
        self.stats = SpecDecodeStats()

    def propose(self, batch: ScheduledBatch) -> list[tuple[int, list[int], torch.Tensor | None]]:
        """Drafts for the batch's decoding requests: ``(index in the batch, draft tokens, their
        probabilities or None)``, as many as the budget gives each (the scheduler may admit
        fewer, for room)."""
        self.budget.start_step()
        candidates = []
        # a request decodes when the step ends at its newest token: one token, or (for proposers that
        # read no hidden states) the tokens a step whose drafts were rejected left to recompute
        after_any_step = not self.proposer.hidden_state_layers
        for i, (request, n) in enumerate(zip(batch.requests, batch.num_tokens)):
            decoding = request.num_computed_tokens + n == request.num_tokens and (
                n == 1 or (after_any_step and request.num_output_tokens > 0)
            )
            if decoding and can_speculate(request):
                if self.budget.wants_drafts(request.request_id):
                    candidates.append(i)
                else:
                    self.budget.skip(request.request_id)
        if not candidates:
            return []
        requests = [batch.requests[i] for i in candidates]
        hidden = None
        if self.proposer.hidden_state_layers:
            layer = self.proposer.hidden_state_layers[0]
            hidden = {layer: torch.stack([self.hidden_states[r.request_id] for r in requests])}
        drafts = self.proposer.propose(
            [DraftRequest(r.request_id, tuple(r.token_ids)) for r in requests], self.num_speculative_tokens, hidden
        )
        self._check(drafts, len(requests))
        limits = [self._limit(r) for r in requests]
        confidences = [
            [None] * len(tokens)
            if drafts.probs is None
            else drafts.probs[k][torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.int64)].tolist()
            for k, tokens in enumerate(drafts.token_ids)
        ]
        taken = self.budget.plan(
            [r.request_id for r in requests], confidences, len(batch.sample_indices), batch.total_tokens, limits
        )
        return [
            (i, list(drafts.token_ids[k][:count]), None if drafts.probs is None else drafts.probs[k][:count])
            for k, (i, count) in enumerate(zip(candidates, taken))
        ]

    def _limit(self, request: Request) -> int:
        """Drafts beyond max_tokens or max_model_len could never be kept."""
        params = request.sampling_params
        left = self.max_model_len - request.num_tokens
        if params.max_tokens is not None:
            left = min(left, params.max_tokens - request.num_output_tokens - 1)
        return max(0, min(left, self.num_speculative_tokens))

    def _check(self, drafts: Drafts, num_requests: int) -> None:
        name = self.proposer.name
        if not isinstance(drafts, Drafts) or len(drafts.token_ids) != num_requests:
            raise RuntimeError(
                f"Proposer {name!r} must return Drafts with one token list per request "
                f"({num_requests}); got {drafts!r:.200}."
            )
        for tokens in drafts.token_ids:
            if len(tokens) > self.num_speculative_tokens or not all(
                isinstance(t, int) and 0 <= t < self.vocab_size for t in tokens
            ):
                raise RuntimeError(
                    f"Proposer {name!r} returned drafts {list(tokens)[:8]}: at most {self.num_speculative_tokens} "
                    f"token ids in [0, {self.vocab_size}) per request."
                )
        if drafts.probs is not None:
            if len(drafts.probs) != num_requests or any(
                tuple(p.shape) != (len(t), self.vocab_size) for p, t in zip(drafts.probs, drafts.token_ids)
            ):
                raise RuntimeError(
                    f"Proposer {name!r} returned draft probabilities not shaped "
                    f"[len(drafts), {self.vocab_size}] per request."
                )

    def record(self, request: Request, num_drafts: int, accepted: int) -> int:
        """After verification: ``accepted`` of the request's ``num_drafts`` drafts were kept."""
        self.budget.record(request.request_id, num_drafts, accepted)
        self.stats.record(num_drafts, accepted)
        return accepted

    def record_step(self, num_tokens: int, seconds: float, decode_only: bool) -> None:
        """Time a decode step for the budget's cost table (prompt chunks cost differently per token)."""
        if decode_only:
            self.budget.costs.record(num_tokens, seconds)

    def remove(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.budget.remove(request_id)
            self.hidden_states.pop(request_id, None)
        self.proposer.remove(request_ids)
