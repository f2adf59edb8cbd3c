"""Token sampling for a batch.

Order, as in vLLM: raw logprobs (if asked) -> min_tokens mask -> penalties ->
greedy argmax | temperature -> min-p -> top-k / top-p -> seeded exponential race.
Every step is one tensor op over the batch; Python loops run over requests only
to build small per-request parameter tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.interfaces.ops import REFERENCE_OPS, LayerOps
from engine.runtime.logprobs import LogprobsTensors, gather_logprobs
from engine.runtime.request import Request
from engine.sampling_params import SamplingParams


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


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Keep the tokens with p >= min_p * p_max in each row, -inf elsewhere.

    logits: [N, V] fp32; min_p: [N] fp32 (0 keeps everything).
    """
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """token_ids: [N, L] int64, padded with vocab_size -> counts [N, V] fp32."""
    counts = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=torch.float32, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=torch.float32))
    return counts[:, :vocab_size]


def apply_penalties(
    logits: torch.Tensor,
    prompt_ids: torch.Tensor,
    output_ids: torch.Tensor,
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> torch.Tensor:
    """logits: [N, V] fp32; prompt_ids [N, Lp], output_ids [N, Lo]: int64 padded with V;
    repetition, presence, frequency: [N] fp32 (1, 0, 0 leave a row alone)."""
    vocab = logits.shape[-1]
    output_counts = token_counts(output_ids, vocab)
    in_output = output_counts > 0
    seen = in_output | (token_counts(prompt_ids, vocab) > 0)
    # repetition (HF / vLLM): shrink a seen token's logit towards -inf
    rep = repetition.unsqueeze(1)
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    # presence and frequency (OpenAI): over output tokens only
    return logits - frequency.unsqueeze(1) * output_counts - presence.unsqueeze(1) * in_output


def pad_token_ids(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    """[len(rows), max len] int64, padded with ``pad``."""
    out = np.full((len(rows), max((len(r) for r in rows), default=0) or 1), pad, dtype=np.int64)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return torch.from_numpy(out).to(device)


def _min_tokens_pending(request: Request) -> bool:
    min_tokens = request.sampling_params.min_tokens
    return bool(min_tokens) and request.num_output_tokens < min_tokens


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [N] int64
    logprobs: LogprobsTensors | None = None  # raw-distribution logprobs, when some request asked for them


class Sampler:
    def __init__(self, device: torch.device, ops: LayerOps = REFERENCE_OPS) -> None:
        self.device = device
        self.ops = ops  # ops.argmax: greedy rows of a batch that needs nothing else

    @staticmethod
    def plain_greedy(requests: list[Request]) -> bool:
        """Whether sampling for ``requests`` is the argmax of their logits as they are: all greedy,
        no logprobs, no penalties, no ``min_tokens`` pending."""
        return all(
            r.sampling_params.greedy and r.sampling_params.logprobs is None and not r.sampling_params.has_penalties
            for r in requests
        ) and not any(_min_tokens_pending(r) for r in requests)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """logits: [N, V] in the model's dtype, row i for requests[i] (not modified) -> the sampled
        tokens. A batch of greedy requests with no logprobs, penalties or pending ``min_tokens``
        takes ``ops.argmax`` on the logits as they are; anything else works on them in fp32."""
        params = [r.sampling_params for r in requests]
        if self.plain_greedy(requests):
            return SamplerOutput(self.ops.argmax(logits))
        logits = logits.float()
        # logprobs describe the model's own distribution: taken before any processing
        raw_logprobs = logits.log_softmax(dim=-1) if any(p.logprobs is not None for p in params) else None
        logits = self._apply_min_tokens(logits, requests)
        if any(p.has_penalties for p in params):
            logits = self._apply_penalties(logits, requests)
        greedy = [p.greedy for p in params]
        token_ids = logits.argmax(dim=-1) if all(greedy) else self._sample(logits, requests, greedy)
        logprobs = None
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, token_ids, max(p.logprobs or 0 for p in params))
        return SamplerOutput(token_ids, logprobs)

    def _apply_min_tokens(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        # until min_tokens outputs exist, the tokens that would stop the request cannot be drawn
        rows: list[int] = []
        cols: list[int] = []
        vocab = logits.shape[-1]
        for i, request in enumerate(requests):
            p = request.sampling_params
            if _min_tokens_pending(request):
                stops = set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids) | request.eos_token_ids
                stops = [t for t in stops if t < vocab]
                rows += [i] * len(stops)
                cols += stops
        if not rows:
            return logits
        index = (torch.tensor(rows, device=self.device), torch.tensor(cols, device=self.device))
        return logits.index_put(index, torch.tensor(float("-inf"), device=self.device))

    def _apply_penalties(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        params = [r.sampling_params for r in requests]
        vocab = logits.shape[-1]
        output_ids = pad_token_ids(
            [r.output_token_ids if p.has_penalties else [] for r, p in zip(requests, params)], vocab, self.device
        )
        prompt_ids = pad_token_ids(
            [r.prompt_token_ids if p.repetition_penalty != 1.0 else [] for r, p in zip(requests, params)],
            vocab,
            self.device,
        )

        def column(name: str) -> torch.Tensor:
            return torch.tensor([getattr(p, name) for p in params], dtype=torch.float32, device=self.device)

        return apply_penalties(
            logits,
            prompt_ids,
            output_ids,
            column("repetition_penalty"),
            column("presence_penalty"),
            column("frequency_penalty"),
        )

    def _sample(self, logits: torch.Tensor, requests: list[Request], greedy: list[bool]) -> torch.Tensor:
        argmax = logits.argmax(dim=-1)
        probs = self.probs(logits, [r.sampling_params for r in requests])
        # exponential race: argmax(p / E) with E ~ Exp(1) draws from p
        noise = torch.empty_like(probs).exponential_()
        for i, request in enumerate(requests):
            if request.sampling_params.seed is not None and not greedy[i]:
                noise[i].exponential_(generator=self.generator(request))
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(torch.tensor(greedy, device=self.device), argmax, sampled)

    def probs(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """The distribution a sampled request draws from: logits [N, V] fp32 (after
        min_tokens and penalties) through temperature, min-p, top-k and top-p, softmaxed.
        Row i follows ``params[i]``; a greedy row is left at temperature 1."""
        temperature = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=self.device)
        logits = logits / temperature.unsqueeze(1)
        if any(p.min_p > 0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=self.device)
            logits = apply_min_p(logits, min_p)
        vocab = logits.shape[-1]
        top_k = None
        if any(p.top_k > 0 for p in params):
            top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=self.device)
        top_p = None
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params], device=self.device, dtype=torch.float32)
        if top_k is not None or top_p is not None:
            logits = apply_top_k_top_p(logits, top_k, top_p)
        return logits.softmax(dim=-1)

    def generator(self, request: Request) -> torch.Generator:
        """The request's own random stream, made from its seed on first use."""
        if request.generator is None:
            request.generator = torch.Generator(device=self.device).manual_seed(request.sampling_params.seed)
        return request.generator
