"""Shared by the xgrammar tests: the backend built on a tokenizer with a model vocabulary
wider than it (the extra ids are never allowed), its masks read back as token ids, and
random walks through them whose text the tests judge with references that know nothing
of grammars."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.interfaces.structured_output import StructuredOutputInit, bitmask_width
from engine.plugins.manager import get_plugin_manager
from engine.sampling_params import StructuredOutputsParams

EXTRA_IDS = 37  # the model's vocabulary beyond the tokenizer's


def backend_class():
    registry = get_plugin_manager(["xgrammar"]).components().registry("structured_output_backends")
    return registry.get("xgrammar")


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


def new_bitmask(backend, rows: int = 1, fill: int = 0) -> torch.Tensor:
    return torch.full((rows, bitmask_width(backend.vocab_size)), fill, dtype=torch.int32)


def mask_ids(row: torch.Tensor, vocab_size: int) -> np.ndarray:
    """The ids a bitmask row allows, ascending (bit t % 32 of word t // 32, little-endian)."""
    bits = np.unpackbits(row.contiguous().numpy().view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab_size])


def allowed_tokens(backend, matcher) -> np.ndarray:
    """The ids ``matcher``'s mask allows, ascending; the same whether the row was clear or full."""
    clear, full = new_bitmask(backend, 1, 0), new_bitmask(backend, 1, -1)
    matcher.fill_bitmask(clear, 0)
    matcher.fill_bitmask(full, 0)
    ids = mask_ids(clear[0], backend.vocab_size)
    assert np.array_equal(ids, mask_ids(full[0], backend.vocab_size)), "fill_bitmask did not overwrite its row"
    return ids


def compile_(backend, **kwargs):
    return backend.compile(StructuredOutputsParams(**kwargs))


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@dataclass
class Walk:
    tokens: list[int] = field(default_factory=list)
    ended: bool = False  # accepted EOS

    def text(self, tokenizer) -> str:
        return tokenizer.decode([t for t in self.tokens if t != tokenizer.eos_token_id])


class Walker:
    """Random walks through a constraint's masks: each step draws an allowed token (EOS,
    once allowed, with probability ``eos_bias``; tokens holding a closing character are
    favoured, so that strings and containers end), checking on the way that every mask
    holds only tokens of the tokenizer, no special token but EOS, EOS exactly when the
    matcher can terminate, and that the drawn token is validated and accepted."""

    CLOSERS = ('"', "}", "]", ")", ">")

    def __init__(self, backend, tokenizer):
        self.backend = backend
        self.tokenizer = tokenizer
        self.eos = tokenizer.eos_token_id
        self.vocab = len(tokenizer)
        self.weights = np.ones(backend.vocab_size)
        for t in range(self.vocab):
            text = tokenizer.decode([t])
            if any(c in text for c in self.CLOSERS):
                self.weights[t] = 12.0
            elif text.isspace():
                self.weights[t] = 0.3
        self.special = set(tokenizer.all_special_ids) - {self.eos}

    def step(self, matcher, rng: random.Random, eos_bias: float) -> int:
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

    def walk(self, compiled, rng: random.Random, *, max_tokens: int = 200, eos_bias: float = 0.6) -> Walk:
        matcher = self.backend.matcher(compiled, 0)
        walk = Walk()
        for _ in range(max_tokens):
            token = self.step(matcher, rng, eos_bias)
            walk.tokens.append(token)
            if token == self.eos:
                walk.ended = True
                break
        return walk

    def texts(self, constraint: StructuredOutputsParams, n: int, seed: int, **kwargs) -> list[str]:
        """The texts of the walks of ``n`` that ended (at least half must)."""
        compiled = self.backend.compile(constraint)
        rng = random.Random(seed)
        walks = [self.walk(compiled, rng, **kwargs) for _ in range(n)]
        ended = [w.text(self.tokenizer) for w in walks if w.ended]
        assert len(ended) >= n // 2, f"only {len(ended)} of {n} walks ended"
        return ended


def byte_tokens(tokenizer) -> dict[int, int]:
    """Byte value -> the id of the byte-level BPE token that is that byte alone (GPT-2's
    byte-to-character table: printable Latin-1 as itself, the rest from U+0100 on)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    vocab = tokenizer.get_vocab()
    return {b: vocab[c] for b, c in chars.items()}
