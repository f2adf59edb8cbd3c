"""The engine's side of speculative decoding: which requests get drafts this step,
room in the KV cache for them, and what verification kept."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Sequence

import torch

from engine.interfaces.spec_proposer import (
    FINAL_HIDDEN_STATES,
    PRE_HEAD_HIDDEN_STATES,
    DraftRequest,
    Drafts,
    SpecProposer,
)
from engine.runtime.kv_cache_manager import KVCacheManager
from engine.runtime.request import Request
from engine.runtime.scheduler import ScheduledBatch
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
    def __init__(
        self, proposer: SpecProposer, num_speculative_tokens: int, kv_manager: KVCacheManager,
        max_num_batched_tokens: int, max_model_len: int, vocab_size: int,
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
        self.kv_manager = kv_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.budget = SpecBudget(num_speculative_tokens)
        self.stats = SpecDecodeStats()
        self.pending_trim: list[Request] = []  # requests with rejected drafts this step

    def plan(self, batch: ScheduledBatch, last_hidden: dict[str, torch.Tensor]) -> None:
        """Propose and admit drafts for the batch's decoding requests; sets ``batch.drafts``."""
        self.budget.start_step()
        candidates = []
        for i, (request, n) in enumerate(zip(batch.requests, batch.num_tokens)):
            decoding = n == 1 and request.num_computed_tokens + 1 == request.num_tokens
            if decoding and can_speculate(request):
                if self.budget.wants_drafts(request.request_id):
                    candidates.append(i)
                else:
                    self.budget.skip(request.request_id)
        if not candidates:
            return
        requests = [batch.requests[i] for i in candidates]
        hidden = None
        if self.proposer.hidden_state_layers:
            layer = self.proposer.hidden_state_layers[0]
            hidden = {layer: torch.stack([last_hidden[r.request_id] for r in requests])}
        drafts = self.proposer.propose(
            [DraftRequest(r.request_id, tuple(r.token_ids)) for r in requests], self.num_speculative_tokens, hidden
        )
        self._check(drafts, len(requests))
        limits = [self._limit(r) for r in requests]
        confidences = [
            [None] * len(tokens) if drafts.probs is None else
            drafts.probs[k][torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.int64)].tolist()
            for k, tokens in enumerate(drafts.token_ids)
        ]
        num_sampled = sum(
            1 for r, n in zip(batch.requests, batch.num_tokens) if r.num_computed_tokens + n == r.num_tokens
        )
        room = self.max_num_batched_tokens - batch.total_tokens
        taken = self.budget.plan([r.request_id for r in requests], confidences, num_sampled, batch.total_tokens,
                                 limits)
        for k, (i, request, count) in enumerate(zip(candidates, requests, taken)):
            count = min(count, room)
            if count and self.kv_manager.allocate_lookahead(request, count):
                batch.drafts[i] = drafts.token_ids[k][:count]
                if drafts.probs is not None:
                    batch.draft_probs[i] = drafts.probs[k][:count]
                room -= count

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
            raise RuntimeError(f"Proposer {name!r} must return Drafts with one token list per request "
                               f"({num_requests}); got {drafts!r:.200}.")
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
                raise RuntimeError(f"Proposer {name!r} returned draft probabilities not shaped "
                                   f"[len(drafts), {self.vocab_size}] per request.")

    def record(self, batch: ScheduledBatch, index: int, request: Request, kept: Sequence[int]) -> int:
        """After verification: the number of the request's drafts that were accepted."""
        drafts = batch.drafts.get(index)
        if not drafts:
            return 0
        accepted = len(kept) - 1
        if accepted < len(drafts):
            self.pending_trim.append(request)
        self.budget.record(request.request_id, len(drafts), accepted)
        self.stats.record(len(drafts), accepted)
        return accepted

    def record_step(self, num_tokens: int, seconds: float, decode_only: bool) -> None:
        """After the step's tokens were appended: give back the blocks of rejected drafts, and
        time a decode step for the cost table."""
        for request in self.pending_trim:
            if not request.status.finished:
                self.kv_manager.trim(request)
        self.pending_trim.clear()
        if decode_only:
            self.budget.costs.record(num_tokens, seconds)

    def remove(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.budget.remove(request_id)
        self.proposer.remove(request_ids)
