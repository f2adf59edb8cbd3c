"""Generation helpers for tests on the tiny checkpoints (``engine.testing.checkpoints``):
random prompts over their vocabulary, the engine's greedy tokens, transformers' argmax
continuation to check those against, and whether two continuations part only at a near tie."""

from __future__ import annotations

import random
from typing import Any

DEFAULT_LENGTHS = (3, 11, 20, 37)


def random_prompts(seed: int, lengths=DEFAULT_LENGTHS, vocab_size: int = 320) -> list[list[int]]:
    """One prompt per length in ``lengths``, ids drawn from ``[3, vocab_size)`` (above the tiny
    checkpoints' pad, BOS and EOS ids) by ``random.Random(seed)``."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


def greedy_tokens(llm: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    """``n`` greedy tokens (EOS ignored) for every prompt, generated as one batch by ``llm`` (an ``engine.LLM``)."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def hf_argmax_tokens(hf_model: Any, prompt: list[int], n: int) -> list[int]:
    """transformers' argmax over its forward of each growing sequence: ``n`` tokens after
    ``prompt`` (``generate`` with ``min_new_tokens`` would suppress the EOS token, which the
    engine's ``ignore_eos`` keeps)."""
    import torch

    sequence = list(prompt)
    for _ in range(n):
        with torch.no_grad():
            sequence.append(int(hf_model(torch.tensor([sequence])).logits[0, -1].argmax()))
    return sequence[len(prompt) :]


def diverges_only_at_a_near_tie(
    hf_model: Any, prompt: list[int], ours: list[int], theirs: list[int], rtol: float = 2**-6
) -> bool:
    """Whether greedy continuation ``ours`` of ``prompt`` equals transformers' ``theirs``, or first
    differs where transformers' logits for the two tokens chosen there are within ``rtol`` of the
    logits' largest magnitude: a tie that rounding (bf16's above all) may break either way."""
    import torch

    first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if first is None:
        return len(ours) == len(theirs)
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + theirs[:first]])).logits[0, -1].float()
    gap = (logits[theirs[first]] - logits[ours[first]]).abs().item()
    return gap <= rtol * logits.abs().max().item()
