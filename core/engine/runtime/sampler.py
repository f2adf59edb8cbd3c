"""Token sampling for a batch: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

import torch

from engine.runtime.request import Request


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask logits outside each row's top-k / top-p set with -inf.

    logits: [N, V] fp32; top_k: [N] int64 (V for "all"); top_p: [N] fp32.
    """
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        remove |= ranks >= top_k.unsqueeze(1)
    if top_p is not None:
        probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
        # drop a token when the tokens ranked above it already reach top_p (the first always stays)
        mass_before = probs.cumsum(dim=-1) - probs
        remove |= mass_before >= top_p.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


class Sampler:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """logits: [N, V] fp32, row i for requests[i] -> token ids [N] int64."""
        greedy = [r.sampling_params.greedy for r in requests]
        argmax = logits.argmax(dim=-1)
        if all(greedy):
            return argmax
        params = [r.sampling_params for r in requests]
        temperature = torch.tensor([1.0 if g else p.temperature for g, p in zip(greedy, params)], device=self.device)
        logits = logits / temperature.unsqueeze(1)
        vocab = logits.shape[-1]
        top_k = None
        if any(p.top_k > 0 for p in params):
            top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=self.device)
        top_p = None
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params], device=self.device, dtype=torch.float32)
        if top_k is not None or top_p is not None:
            logits = apply_top_k_top_p(logits, top_k, top_p)
        probs = logits.softmax(dim=-1)
        # exponential race: argmax(p / E) with E ~ Exp(1) draws from p
        noise = torch.empty_like(probs).exponential_()
        for i, request in enumerate(requests):
            seed = request.sampling_params.seed
            if seed is not None and not greedy[i]:
                if request.generator is None:
                    request.generator = torch.Generator(device=self.device).manual_seed(seed)
                noise[i].exponential_(generator=request.generator)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(torch.tensor(greedy, device=self.device), argmax, sampled)
