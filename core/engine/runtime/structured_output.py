"""Structured output in the step: each constrained request's token bitmask filled for the
whole batch in one backend call (while the forward runs), applied to the logits in place,
and the request's matcher advanced by the tokens it keeps.

A request's matcher (``request.grammar``) moves only with tokens the request keeps: the
masks of speculative drafts are filled by accepting the drafts, filling, and rolling them
back, so that after verification the matcher is where the request's tokens put it. A
preempted request keeps its tokens (it is recomputed, not resampled), so its matcher
stays valid.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.interfaces.ops import REFERENCE_OPS, LayerOps
from engine.interfaces.structured_output import bitmask_width
from engine.runtime.request import Request, RequestStatus

if TYPE_CHECKING:
    from engine.interfaces.structured_output import StructuredOutputBackend

logger = logging.getLogger("engine")


@dataclass
class StepMasks:
    """The bitmasks of one step: ``bitmask[rows[i]]`` … for each constrained request
    (index ``i`` in the batch) one row per position it samples at (its drafts, then one)."""

    bitmask: torch.Tensor
    rows: dict[int, range] = field(default_factory=dict)


def fill_step_masks(
    backend: StructuredOutputBackend, requests: list[Request], indices: list[int], drafts: dict[int, list[int]]
) -> StepMasks | None:
    """The masks of the constrained requests among ``indices`` (batch positions that sample):
    every request's next-token row in one ``backend.fill_bitmask`` call, then the rows after
    each accepted-in-turn draft. None when no request is constrained."""
    constrained = [i for i in indices if requests[i].grammar is not None]
    if not constrained:
        return None
    rows: dict[int, range] = {}
    total = 0
    for i in constrained:
        n = len(drafts.get(i, ())) + 1
        rows[i] = range(total, total + n)
        total += n
    bitmask = torch.zeros(total, bitmask_width(backend.vocab_size), dtype=torch.int32)
    backend.fill_bitmask([requests[i].grammar for i in constrained], bitmask, [rows[i][0] for i in constrained])
    for i in constrained:
        request, pending = requests[i], drafts.get(i, ())
        grammar = request.grammar
        _allow_stop_tokens(request, bitmask, rows[i][0])
        accepted = 0
        for k, token in enumerate(pending):
            if not grammar.accept_tokens([token]):
                break  # the scheduler validated the drafts: this does not happen
            accepted += 1
            grammar.fill_bitmask(bitmask, rows[i][k + 1])
            _allow_stop_tokens(request, bitmask, rows[i][k + 1])
        if accepted:
            grammar.rollback(accepted)
    return StepMasks(bitmask, rows)


def _allow_stop_tokens(request: Request, bitmask: torch.Tensor, row: int) -> None:
    # the request's own stop tokens end it where the constraint could end (the backend allows EOS there)
    stop_ids = request.sampling_params.stop_token_ids
    if not stop_ids or not request.grammar.can_terminate():
        return
    for token in stop_ids:
        word = token // 32
        if word < bitmask.shape[1]:
            value = (int(bitmask[row, word]) & 0xFFFFFFFF) | (1 << (token % 32))
            bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], ops: LayerOps = REFERENCE_OPS) -> None:
    """Set ``logits[rows[j]]`` to -inf, in place, for every token ``bitmask[j]`` does not allow
    (the platform's ``ops.apply_token_bitmask``)."""
    if rows:
        ops.apply_token_bitmask(logits, bitmask.to(logits.device), torch.tensor(rows, dtype=torch.int64))


def mask_logits(
    logits: torch.Tensor, masks: StepMasks | None, order: list[int], positions: list[int], ops: LayerOps = REFERENCE_OPS
) -> None:
    """``logits`` holds, for each batch index in ``order``, ``positions[k]`` consecutive rows
    (1, or its drafts + 1): mask the rows of constrained requests in place."""
    if masks is None:
        return
    source: list[int] = []
    target: list[int] = []
    start = 0
    for i, count in zip(order, positions):
        if i in masks.rows:
            source.extend(masks.rows[i][:count])
            target.extend(range(start, start + count))
        start += count
    if source:
        bitmask = masks.bitmask if source == list(range(len(masks.bitmask))) else masks.bitmask[source]
        apply_bitmask(logits, bitmask, target, ops)


def valid_drafts(request: Request, drafts: list[int]) -> list[int]:
    """The leading drafts that the request's constraint allows."""
    if request.grammar is None or not drafts:
        return drafts
    return drafts[: request.grammar.validate_tokens(drafts)]


def advance(request: Request, token: int, status: RequestStatus | None) -> RequestStatus | None:
    """Move the request's matcher past its newest ``token``; returns the status it finishes
    with: ``status`` (from its stop conditions), or "stop" once the constraint has ended."""
    grammar = request.grammar
    if grammar is None or status is RequestStatus.FINISHED_STOPPED:
        return status
    if not grammar.accept_tokens([token]):
        # the mask excluded it: only a token the sampler could not avoid (every token masked)
        logger.error("request %s: token %d breaks its output constraint; it is aborted", request.request_id, token)
        return RequestStatus.FINISHED_ABORTED
    if grammar.is_terminated():
        if token in request.eos_token_ids:
            request.stop_reason = token
        return RequestStatus.FINISHED_STOPPED
    return status
