"""What ``engine bench serve`` sends and when: the prompts with their output lengths
(random words of a target token count, or a JSONL file), and the arrival times.

Everything here is a pure function of its arguments and a seed. Token counts of text
depend on the served model's tokenizer, which the client does not have: random prompts
are words, and :class:`PromptLengthFit` (measured against the server, see ``runner``)
says how many words make a given number of prompt tokens.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

# common English words, most of them one token in a BPE vocabulary trained on English
VOCABULARY = tuple(
    """the of and to in is that for it as with was on be at by this had not are but from or have an they
    which one you were her all she there would their we him been has when who will more no if out so said
    what up its about into than them can only other new some could time these two may then do first any my
    now such like our over man me even most made after also did many before must through back years where
    much your way well down should because each just those people how too little state good very make world
    still own see men work long get here between both life being under never day same another know while last
    might us great old year off come since against go came right used take three house water small found
    thought went say part once general high upon school every does got united left number course war
    until always away something fact though less public put think almost hand enough far took head yet
    government system better set told nothing night end why called eyes find going look asked later
    knew point next program city business give group toward young days let room president side social given
    present several order national possible rather second face per among form important often things looked
    early white case john become large big need four within felt along children saw best church ever least
    power development light thing seemed family interest want members mind country area others done turned
    although open god service certain kind problem began different door thus help sense means whole matter
    perhaps itself york times law human line above name example action company hands local show whether five
    history gave today either act feet across taken past quite anything seen having death experience body
    word half really field car words already themselves information tell together college shall money
    period held keep sure probably free seems real behind cannot miss political air question making office
    brought whose special major heard problems federal became study ago moment available known result street
    economic boy position reason change south board individual job areas society west close turn love community
    true court force full seem am front nature""".split()
)


@dataclass(frozen=True)
class PromptSpec:
    """One request's prompt: its text, or only a target length in prompt tokens (text made
    of random words later); and how many output tokens to ask for."""

    output_len: int
    prompt: str | None = None
    prompt_len: int | None = None


def spread(center: int, range_ratio: float) -> tuple[int, int]:
    """The inclusive integer range lengths are drawn from, as vLLM's random dataset:
    [floor(center * (1 - r)), ceil(center * (1 + r))], at least 1."""
    return max(1, math.floor(center * (1 - range_ratio))), max(1, math.ceil(center * (1 + range_ratio)))


def random_specs(num_prompts: int, input_len: int, output_len: int, range_ratio: float, seed: int) -> list[PromptSpec]:
    """``num_prompts`` (prompt length, output length) pairs, each drawn uniformly from its
    :func:`spread`."""
    rng = random.Random(f"lengths:{seed}")
    inputs, outputs = spread(input_len, range_ratio), spread(output_len, range_ratio)
    return [PromptSpec(output_len=rng.randint(*outputs), prompt_len=rng.randint(*inputs)) for _ in range(num_prompts)]


def file_specs(path: str | Path, num_prompts: int, default_output_len: int) -> tuple[list[PromptSpec], int]:
    """The first ``num_prompts`` entries of a JSONL file, each line ``{"prompt": text, "output_len": N}``
    or ``{"prompt_len": N, "output_len": N}`` (``output_len`` defaults to ``default_output_len``);
    a file with fewer lines is cycled. Returns (entries, lines in the file)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--dataset {str(path)!r} is neither 'random' nor a file.")
    entries = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{path} line {number} is not JSON ({exc}).") from None
            entries.append(_file_entry(entry, path, number, default_output_len))
    if not entries:
        raise ValueError(f"{path} holds no prompts: one JSON object a line, with 'prompt' or 'prompt_len'.")
    return [entries[i % len(entries)] for i in range(num_prompts)], len(entries)


def _file_entry(entry: object, path: Path, number: int, default_output_len: int) -> PromptSpec:
    where = f"{path} line {number}"
    if not isinstance(entry, dict):
        raise ValueError(f'{where} is not a JSON object; expected {{"prompt": ..., "output_len": N}}.')
    output_len = entry.get("output_len", default_output_len)
    if not isinstance(output_len, int) or isinstance(output_len, bool) or output_len < 1:
        raise ValueError(f"{where}: output_len must be a positive integer, got {output_len!r}.")
    prompt, prompt_len = entry.get("prompt"), entry.get("prompt_len")
    if isinstance(prompt, str) and prompt:
        return PromptSpec(output_len=output_len, prompt=prompt)
    if isinstance(prompt_len, int) and not isinstance(prompt_len, bool) and prompt_len >= 1:
        return PromptSpec(output_len=output_len, prompt_len=prompt_len)
    raise ValueError(f"{where} needs a non-empty 'prompt' string or a positive integer 'prompt_len'.")


@dataclass(frozen=True)
class PromptLengthFit:
    """Prompt tokens the server counts for a prompt of ``w`` random words:
    ``fixed_tokens + tokens_per_word * w`` (``fixed_tokens``: BOS, a chat template)."""

    tokens_per_word: float = 1.0
    fixed_tokens: float = 0.0
    measured: bool = False

    @classmethod
    def through(cls, points: Sequence[tuple[int, int]]) -> "PromptLengthFit":
        """The line through two (words, prompt tokens) measurements; one token a word when the
        measurements do not rise with the words."""
        (w1, t1), (w2, t2) = points
        if w2 == w1 or t2 <= t1:
            return cls()
        slope = (t2 - t1) / (w2 - w1)
        return cls(tokens_per_word=slope, fixed_tokens=t1 - slope * w1, measured=True)

    def words_for(self, prompt_tokens: int) -> int:
        return max(1, round((prompt_tokens - self.fixed_tokens) / self.tokens_per_word))


def random_text(num_words: int, rng: random.Random) -> str:
    return " ".join(rng.choice(VOCABULARY) for _ in range(num_words))


def prompt_texts(specs: Sequence[PromptSpec], fit: PromptLengthFit, seed: int) -> list[str]:
    """Each spec's prompt: its own text, or random words that make about its ``prompt_len`` tokens."""
    rng = random.Random(f"words:{seed}")
    return [s.prompt if s.prompt is not None else random_text(fit.words_for(s.prompt_len or 1), rng) for s in specs]


def poisson_arrivals(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Send times in seconds after the start: the first at 0, then gaps drawn from an exponential
    distribution of mean ``1 / request_rate`` (Poisson arrivals); all 0 for an infinite rate."""
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(f"arrivals:{seed}")
    times, now = [], 0.0
    for i in range(num_requests):
        if i:
            now += rng.expovariate(request_rate)
        times.append(now)
    return times
