"""Logprobs of sampled and prompt tokens: gathered as tensors for a batch, kept on
each request as small lists, turned into ``{token_id: Logprob}`` dicts for output.

All logprobs are ``log_softmax`` of the model's raw fp32 logits, before any
sampling transform (temperature, penalties, min-p, top-k, top-p).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import torch

from engine.outputs import Logprob

if TYPE_CHECKING:
    from engine.runtime.request import Request


class LogprobEntry(NamedTuple):
    """One position: ``token_ids[0]`` is the sampled (or prompt) token, then the top-N."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int  # of token_ids[0]: 1 + tokens with a strictly higher logprob


@dataclass
class LogprobsTensors:
    token_ids: torch.Tensor  # [N, 1 + num_top] int64: the chosen token, then the top num_top
    logprobs: torch.Tensor  # [N, 1 + num_top] fp32
    ranks: torch.Tensor  # [N] int64, of the chosen token

    def entries(self, num_tops: list[int | None]) -> list[LogprobEntry | None]:
        """Row i cut to its own ``num_tops[i]`` (None: no entry). One device->host copy."""
        ids, logprobs, ranks = self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist()
        return [
            None if n is None else LogprobEntry(ids[i][: 1 + n], logprobs[i][: 1 + n], ranks[i])
            for i, n in enumerate(num_tops)
        ]


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> LogprobsTensors:
    """logprobs: [N, V] fp32 (log_softmax'd); token_ids: [N] int64, the token chosen per row."""
    token_logprobs = logprobs.gather(-1, token_ids.unsqueeze(-1))  # [N, 1]
    ranks = (logprobs > token_logprobs).sum(dim=-1) + 1
    num_top = min(num_top, logprobs.shape[-1])
    ids, values = token_ids.unsqueeze(-1), token_logprobs
    if num_top > 0:
        top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)
        ids, values = torch.cat([ids, top_ids], dim=-1), torch.cat([values, top_logprobs], dim=-1)
    return LogprobsTensors(ids, values, ranks)


def record_sample_logprobs(requests: list[Request], tensors: LogprobsTensors) -> None:
    """Append this step's entry to ``output_logprobs`` of each request that asked for logprobs."""
    num_tops = [r.sampling_params.logprobs for r in requests]
    for request, entry in zip(requests, tensors.entries(num_tops)):
        if entry is not None:
            request.output_logprobs.append(entry)


def record_prompt_logprobs(
    logits_of_rows: Callable[[slice], torch.Tensor],
    requests: list[Request],
    num_new_tokens: list[int],
    query_ends: list[int],
) -> None:
    """Extend ``prompt_logprobs`` of the requests that asked for them with this step's prompt rows.

    ``logits_of_rows(rows)`` gives the logits of those rows of the step's flattened hidden
    states [T, H]; request i owns rows
    ``[query_ends[i] - num_new_tokens[i], query_ends[i])``, at positions from
    ``num_computed_tokens``. The row at position q scores prompt token q + 1, so
    positions 0 .. P-2 carry entries. Positions recorded before (a preempted
    request recomputes its prompt) are not recorded twice.
    """
    for request, n, end in zip(requests, num_new_tokens, query_ends):
        num_top = request.sampling_params.prompt_logprobs
        if num_top is None:
            continue
        computed = request.num_computed_tokens
        first = len(request.prompt_logprobs)
        last = min(computed + n, request.num_prompt_tokens - 1)
        if computed > first and first < request.num_prompt_tokens - 1:
            raise RuntimeError(
                f"Request {request.request_id!r} asked for prompt_logprobs but its prompt positions "
                f"{first}..{computed - 1} were never computed (a prefix-cache hit?): requests with "
                f"needs_prompt_logits must compute their whole prompt."
            )
        if last <= first:
            continue
        start = end - n - computed  # row of position 0
        logits = logits_of_rows(slice(start + first, start + last)).float()
        targets = torch.tensor(request.prompt_token_ids[first + 1 : last + 1], device=logits.device)
        tensors = gather_logprobs(logits.log_softmax(dim=-1), targets, num_top)
        request.prompt_logprobs.extend(tensors.entries([num_top] * len(targets)))


def logprob_dict(entry: LogprobEntry, tokenizer: Any | None) -> dict[int, Logprob]:
    """``{token_id: Logprob}`` for one position (vLLM's shape): the chosen token with its
    rank, and the top-N with ranks 1..N."""
    ranks = itertools.chain((entry.rank,), range(1, len(entry.token_ids)))
    return {
        token_id: Logprob(logprob, rank, None if tokenizer is None else tokenizer.decode([token_id]))
        for token_id, logprob, rank in zip(entry.token_ids, entry.logprobs, ranks)
    }
