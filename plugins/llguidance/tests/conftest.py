"""A tiny byte-level BPE tokenizer, the llguidance backend built on it with a model vocabulary
wider than the tokenizer (the extra ids are never allowed), and random walks through its
masks."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from engine.interfaces.structured_output import StructuredOutputInit, bitmask_width
from engine.plugins.manager import get_plugin_manager
from engine.sampling_params import StructuredOutputsParams
from engine.testing.checkpoints import make_tiny_tokenizer

EXTRA_IDS = 37  # the model's vocabulary beyond the tokenizer's


def backend_class():
    registry = get_plugin_manager(["llguidance"]).components().registry("structured_output_backends")
    return registry.get("llguidance")


def build_backend(tokenizer, *, vocab_size=None, eos_token_ids=None, config=None, max_threads=2):
    return backend_class()(
        StructuredOutputInit(
            tokenizer=tokenizer,
            vocab_size=len(tokenizer) + EXTRA_IDS if vocab_size is None else vocab_size,
            eos_token_ids=(tokenizer.eos_token_id,) if eos_token_ids is None else eos_token_ids,
            config=config or {},
            max_threads=max_threads,
        )
    )


@pytest.fixture(scope="session")
def tokenizer():
    return make_tiny_tokenizer(512)


@pytest.fixture(scope="session")
def backend(tokenizer):
    backend = build_backend(tokenizer)
    yield backend
    backend.close()


def allowed_tokens(backend, matcher) -> np.ndarray:
    """The token ids ``matcher``'s mask allows, ascending."""
    bitmask = torch.zeros(1, bitmask_width(backend.vocab_size), dtype=torch.int32)
    matcher.fill_bitmask(bitmask, 0)
    return mask_ids(bitmask[0], backend.vocab_size)


def mask_ids(row: torch.Tensor, vocab_size: int) -> np.ndarray:
    bits = np.unpackbits(row.numpy().view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab_size])


@dataclass
class Walk:
    tokens: list[int] = field(default_factory=list)
    ended: bool = False  # accepted EOS

    def text(self, tokenizer) -> str:
        return tokenizer.decode([t for t in self.tokens if t != tokenizer.eos_token_id])


class Walker:
    """Random walks through a constraint's masks: each step draws an allowed token (EOS,
    once allowed, with probability ``eos_bias``; tokens holding a closing character are
    favoured so that strings and containers end), checking on the way that every mask
    holds only tokens of the tokenizer, no special token but EOS, EOS exactly when the
    matcher can terminate, and that the drawn token is accepted."""

    CLOSERS = ('"', "}", "]", ")", ">")

    def __init__(self, backend, tokenizer):
        self.backend = backend
        self.tokenizer = tokenizer
        self.eos = tokenizer.eos_token_id
        vocab = len(tokenizer)
        texts = [tokenizer.decode([t]) for t in range(vocab)]
        self.weights = np.ones(backend.vocab_size)
        for t, text in enumerate(texts):
            if any(c in text for c in self.CLOSERS):
                self.weights[t] = 12.0
            elif text.isspace():
                self.weights[t] = 0.3
        self.special = set(tokenizer.all_special_ids) - {self.eos}
        self.vocab = vocab

    def walk_step(self, matcher, rng: random.Random, eos_bias: float = 0.0) -> int:
        """Check ``matcher``'s mask, draw one token from it and accept it; the token."""
        ids = allowed_tokens(self.backend, matcher)
        assert len(ids), "an empty mask"
        assert ids[-1] < self.vocab, f"ids beyond the tokenizer allowed: {ids[ids >= self.vocab]}"
        assert not self.special & set(ids.tolist()), "a special token other than EOS allowed"
        eos_allowed = self.eos in ids
        assert eos_allowed == matcher.can_terminate()
        if eos_allowed and (len(ids) == 1 or rng.random() < eos_bias):
            token = self.eos
        else:
            choices = ids[ids != self.eos]
            token = int(rng.choices(choices.tolist(), weights=self.weights[choices].tolist())[0])
        assert matcher.validate_tokens([token]) == 1
        assert matcher.accept_tokens([token]), token
        assert matcher.is_terminated() == (token == self.eos)
        return token

    def walk(self, compiled, rng: random.Random, *, max_tokens: int = 300, eos_bias: float = 0.6) -> Walk:
        matcher = self.backend.matcher(compiled, 0)
        walk = Walk()
        for _ in range(max_tokens):
            token = self.walk_step(matcher, rng, eos_bias)
            walk.tokens.append(token)
            if token == self.eos:
                walk.ended = True
                break
        return walk

    def walks(self, constraint: StructuredOutputsParams, n: int, seed: int, **kwargs) -> list[Walk]:
        compiled = self.backend.compile(constraint)
        rng = random.Random(seed)
        return [self.walk(compiled, rng, **kwargs) for _ in range(n)]


@pytest.fixture(scope="session")
def walker(backend, tokenizer):
    return Walker(backend, tokenizer)
