"""A request's reasoning block, followed token by token: where the output is (before, in or
after the reasoning), how many reasoning tokens it holds, and, under a thinking budget, the
closing tokens the engine writes once the budget is spent.

The block is recognised by token ids (the reasoning parser's markers, encoded): it opens
when the output's first tokens are the start marker (or the prompt left it open) and closes
at the first end marker. The markers' own tokens are not reasoning tokens.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.runtime.request import Request
    from engine.sampling_params import ReasoningMarkers


class Phase(enum.Enum):
    BEFORE = "before"  # no output yet that says whether it opens a block
    IN = "in"
    AFTER = "after"  # the block closed, or the output did not open one


class ReasoningTracker:
    def __init__(self, markers: ReasoningMarkers, budget: int | None) -> None:
        self.markers = markers
        self.budget = budget
        self.phase = Phase.IN if markers.starts_open else Phase.BEFORE
        self.num_reasoning_tokens = 0
        self._opening: list[int] = []  # output tokens while BEFORE
        self._recent: list[tuple[int, bool]] = []  # the last tokens in the block (and whether counted)
        self._forced: list[int] = []  # closing tokens still to write
        self._wrote_forced = False  # the token being observed is one the engine wrote

    @property
    def forcing(self) -> bool:
        """Closing tokens are still to be written."""
        return bool(self._forced)

    @property
    def may_force(self) -> bool:
        """A later token may be one the engine writes (the step must see what was sampled)."""
        return self.budget is not None and self.phase is not Phase.AFTER

    def next_forced(self) -> int | None:
        """The token the engine writes next (None: the model's sample is kept)."""
        if self._forced:
            return self._forced[0]
        if self.phase is Phase.IN and self.budget is not None and self.num_reasoning_tokens >= self.budget:
            return self.markers.forced_end[0]
        return None

    def substitute(self, token: int) -> int:
        """The token the output gets in place of the sampled ``token``: the next closing
        token while the budget forces the block closed, else ``token``."""
        self._wrote_forced = True
        if self._forced:
            return self._forced.pop(0)
        if self.phase is Phase.IN and self.budget is not None and self.num_reasoning_tokens >= self.budget:
            self._forced = list(self.markers.forced_end)
            return self._forced.pop(0)
        self._wrote_forced = False
        return token

    def observe(self, token: int) -> bool:
        """Follow the output past its newest ``token``; True when it closed the block."""
        if self.phase is Phase.BEFORE:
            self._opening.append(token)
            start = self.markers.start
            if tuple(self._opening) == start:
                self.phase = Phase.IN
                if self.budget is not None and self.budget == 0:
                    self._forced = list(self.markers.forced_end)
            elif tuple(self._opening) != start[: len(self._opening)]:
                self.phase = Phase.AFTER
            return False
        if self.phase is not Phase.IN:
            return False
        # the engine's closing tokens are never reasoning tokens; the model's are, until they
        # turn out to be the end marker
        end = self.markers.end
        counted = not self._wrote_forced
        self.num_reasoning_tokens += counted
        self._recent.append((token, counted))
        del self._recent[: -len(end)]
        if tuple(t for t, _ in self._recent) == end:
            self.num_reasoning_tokens -= sum(c for _, c in self._recent)
            self.phase = Phase.AFTER
            return True
        return False


def start_tracking(request: Request) -> None:
    """Give ``request`` its tracker when its parameters name reasoning markers; an output
    constraint then waits for the block to close when the output begins inside one."""
    params = request.sampling_params
    if params.reasoning_markers is None:
        return
    request.reasoning = ReasoningTracker(params.reasoning_markers, params.thinking_token_budget)
    if request.reasoning.phase is Phase.IN and request.grammar is not None:
        request.deferred_grammar, request.grammar = request.grammar, None


def next_token(request: Request, token: int) -> int:
    """The token ``request`` keeps for the sampled ``token`` (the budget may replace it),
    with the tracker moved past it."""
    tracker = request.reasoning
    if tracker is None:
        return token
    token = tracker.substitute(token)
    tracker.observe(token)
    return token


def release_constraint(request: Request) -> None:
    """Once the reasoning block has closed (and its closing tokens are written), put the
    deferred output constraint in force: it applies from the next token on."""
    tracker = request.reasoning
    if request.deferred_grammar is not None and tracker.phase is Phase.AFTER and not tracker.forcing:
        request.grammar, request.deferred_grammar = request.deferred_grammar, None


def may_force(request: Request) -> bool:
    return request.reasoning is not None and request.reasoning.may_force


def force_logits(logits: torch.Tensor, requests: list[Request]) -> None:
    """Rows of ``logits`` (one per request, in order) of requests whose next token the engine
    writes allow that token alone, so that it is what the sampler draws (its logprob, as
    under an output constraint, is that of the masked distribution)."""
    for row, request in enumerate(requests):
        token = request.reasoning.next_forced() if request.reasoning is not None else None
        if token is not None:
            logits[row].fill_(float("-inf"))
            logits[row, token] = 0.0
