"""Verification: the target's logits at every drafted position decide what is kept.

Greedy requests keep the longest run of drafts that equal the target's argmax, then
the target's own token (the bonus). Sampled requests use rejection sampling (Leviathan
et al., Chen et al. 2023): draft ``d`` at a position where the target draws from ``p``
and the proposer from ``q`` is accepted with probability ``min(1, p(d) / q(d))``; the
first rejected position draws from ``max(0, p − q)`` renormalised instead, and when
every draft is accepted one more token is drawn from the next ``p``. The tokens that
come out are distributed exactly as the target's own samples. A proposer that gives
no probabilities has ``q`` = one-hot on its draft.
"""

from __future__ import annotations

import torch

from engine.runtime.request import Request
from engine.runtime.sampler import Sampler


def accept_greedy(target: list[int], drafts: list[int]) -> list[int]:
    """target: the argmax at each of the len(drafts) + 1 positions -> the tokens kept."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == target[accepted]:
        accepted += 1
    return [*drafts[:accepted], target[accepted]]


def accept_sampled(
    p: torch.Tensor, drafts: list[int], q: torch.Tensor | None, generator: torch.Generator | None
) -> list[int]:
    """p: [k + 1, V] target probabilities; q: [k, V] draft probabilities or None (one-hot)."""
    k = len(drafts)
    index = torch.arange(k, device=p.device)
    draft_ids = torch.tensor(drafts, dtype=torch.int64, device=p.device)
    p_draft = p[index, draft_ids]
    q_draft = q[index, draft_ids] if q is not None else torch.ones_like(p_draft)
    uniform = torch.rand(k, generator=generator, device=p.device)
    # accepted while u < p/q, i.e. u * q < p (a draft the proposer gave no mass to is rejected)
    rejected = (uniform * q_draft >= p_draft).tolist()
    accepted = rejected.index(True) if True in rejected else k
    if accepted == k:
        distribution = p[k]
    else:
        residual = p[accepted] - (
            q[accepted] if q is not None else torch.nn.functional.one_hot(draft_ids[accepted], p.shape[-1]).to(p.dtype)
        )
        residual = residual.clamp(min=0)
        total = residual.sum()
        # p <= q everywhere only when p == q at this row: then the draft is always accepted
        distribution = residual / total if total > 0 else p[accepted]
    token = int(torch.multinomial(distribution, 1, generator=generator))
    return [*drafts[:accepted], token]


def verify(
    sampler: Sampler,
    logits: torch.Tensor,
    requests: list[Request],
    drafts: list[list[int]],
    draft_probs: list[torch.Tensor | None],
) -> list[list[int]]:
    """logits: [sum(len(d) + 1), V] in the model's dtype, request i's rows contiguous and
    in position order -> the tokens each request keeps (accepted drafts + one more)."""
    params = [r.sampling_params for r in requests]
    counts = [len(d) + 1 for d in drafts]
    rows = torch.split(logits, counts)
    results: list[list[int]] = [[] for _ in requests]
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        target = sampler.ops.argmax(torch.cat([rows[i] for i in greedy])).tolist()
        start = 0
        for i in greedy:
            results[i] = accept_greedy(target[start : start + counts[i]], drafts[i])
            start += counts[i]
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        row_params = [params[i] for i in sampled for _ in range(counts[i])]
        probs = torch.split(
            sampler.probs(torch.cat([rows[i] for i in sampled]).float(), row_params), [counts[i] for i in sampled]
        )
        for i, p in zip(sampled, probs):
            request = requests[i]
            generator = sampler.generator(request) if request.sampling_params.seed is not None else None
            results[i] = accept_sampled(p, drafts[i], draft_probs[i], generator)
    return results
