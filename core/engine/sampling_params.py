"""Per-request sampling parameters (the vLLM-shaped ``SamplingParams``)."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

_GREEDY_EPS = 1e-5
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
TOP_K_MAX = 2**31 - 1


CONSTRAINT_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on a request's output (vLLM's ``StructuredOutputsParams``); exactly one of:

    - ``json``: a JSON Schema (a dict, or its JSON text); the output is one JSON value that
      validates against it.
    - ``json_object``: True: any JSON object.
    - ``regex``: the whole output matches it (``re.fullmatch``).
    - ``choice``: the output is one of these strings.
    - ``grammar``: an EBNF grammar in GBNF (llama.cpp) notation, rooted at ``root``.
    - ``structural_tag``: free text in which every trigger string starts a segment
      ``begin + JSON + end`` whose JSON follows the structure's schema; a dict (or its JSON
      text) ``{"structures": [{"begin": ..., "schema": {...}, "end": ...}], "triggers": [...]}``,
      with two optional booleans (default false) that force a segment, as tool calling
      needs: ``at_least_one``: the output begins with a segment (no text before it), then
      goes on as above; ``stop_after_first``: the output ends right after its first
      segment. With both, the output is exactly one segment.

    ``disable_any_whitespace``: JSON is written without whitespace between its tokens
    (otherwise any JSON whitespace may appear there). EOS and stop tokens are masked until
    the constraint can end; the request finishes (reason "stop") once it has ended. A
    request that runs out of ``max_tokens`` first ends with reason "length" and its text
    is then an incomplete instance.
    """

    json: dict | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    structural_tag: dict | str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in CONSTRAINT_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs must set exactly one of {', '.join(CONSTRAINT_KINDS)}; got "
                f"{', '.join(given) or 'none'}."
            )
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"structured_outputs.json must be a JSON Schema object, got {type(self.json).__name__}.")
        if isinstance(self.json, str):
            try:
                schema = json.loads(self.json)
            except json.JSONDecodeError as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON: {exc}.") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("structured_outputs.json must be a JSON Schema object.")
        if self.json_object not in (None, True, False):
            raise ValueError(f"structured_outputs.json_object must be true, got {self.json_object!r}.")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string.")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise ValueError("structured_outputs.choice must be a non-empty list of strings.")
            if any(not isinstance(c, str) for c in self.choice):
                raise ValueError(f"structured_outputs.choice must hold strings only, got {list(self.choice)!r}.")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.structural_tag is not None:
            tag = self.structural_tag
            if isinstance(tag, str):
                try:
                    tag = json.loads(tag)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"structured_outputs.structural_tag is not valid JSON: {exc}.") from None
            if not isinstance(tag, dict):
                raise ValueError("structured_outputs.structural_tag must be a JSON object.")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs.disable_any_whitespace must be true or false.")

    @property
    def kind(self) -> str:
        """Which constraint this is: one of ``CONSTRAINT_KINDS``."""
        return next(k for k in CONSTRAINT_KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> Any:
        """The constraint itself: a schema dict (``json``; ``json_object`` gives None), a regex or
        grammar string, the tuple of choices, or the structural tag as a dict."""
        value = getattr(self, self.kind)
        if self.kind in ("json", "structural_tag") and isinstance(value, str):
            return json.loads(value)
        return None if self.kind == "json_object" else value

    @property
    def key(self) -> str:
        """A canonical text of the constraint: equal keys compile to the same grammar."""
        return json.dumps(
            [self.kind, self.spec, self.disable_any_whitespace], sort_keys=True, separators=(",", ":"), default=list
        )

    @property
    def size(self) -> int:
        """Characters in the constraint's text (bounded by the engine before compiling)."""
        return len(self.key)


@dataclass(frozen=True)
class ReasoningMarkers:
    """A thinking model's reasoning markers as token ids (from its reasoning parser):
    ``start`` opens the reasoning, ``end`` closes it, ``forced_end`` (which begins with
    ``end``) is what the engine writes when a thinking budget runs out; ``starts_open``:
    the prompt left the reasoning open, so the output begins inside it."""

    start: tuple[int, ...]
    end: tuple[int, ...]
    forced_end: tuple[int, ...]
    starts_open: bool = False

    def __post_init__(self) -> None:
        for name in ("start", "end", "forced_end"):
            ids = getattr(self, name)
            if not ids or any(not _is_int(t) or t < 0 for t in ids):
                raise ValueError(f"reasoning_markers.{name} must be a non-empty sequence of token ids, got {ids!r}.")
            object.__setattr__(self, name, tuple(ids))
        if self.forced_end[: len(self.end)] != self.end:
            raise ValueError("reasoning_markers.forced_end must begin with reasoning_markers.end.")


@dataclass
class SamplingParams:
    """How to pick each next token, what to report about it, and when to stop.

    Picking (in this order, as in vLLM):

    - ``min_tokens``: until that many output tokens exist, EOS and
      ``stop_token_ids`` are masked out (logit -inf) and stop strings are not
      honoured.
    - ``repetition_penalty`` (1: off): for every token seen in the prompt or
      the output, a positive logit is divided by it and a negative one
      multiplied (HF / vLLM).
    - ``presence_penalty``, ``frequency_penalty`` (0: off; in [-2, 2]): over
      output tokens only, ``logit -= presence * (count > 0) + frequency * count``
      (OpenAI).
    - ``temperature``: 0 means greedy (argmax after the penalties above);
      otherwise logits are divided by it.
    - ``min_p`` (0: off): keep the tokens with ``p >= min_p * p_max``.
    - ``top_k``: keep the k most likely tokens (0 or -1: all).
    - ``top_p``: keep the smallest set of tokens whose probability reaches p.
    - ``seed``: a per-request generator, so results do not depend on what else
      is in the batch. With ``n > 1``, sample i uses ``seed + i``.
    - ``n``: independent samples for the same prompt, returned as
      ``outputs[0..n-1]`` of one ``RequestOutput`` (greedy gives n equal ones).

    Reporting:

    - ``logprobs`` (None: off): for every output token, its logprob and rank
      plus the ``logprobs`` most likely tokens (0: the sampled token alone).
    - ``prompt_logprobs`` (None: off): the same for every prompt token after
      the first (the first has no prediction: its entry is None).
    - Logprobs are of the model's raw distribution: ``log_softmax`` of the
      unprocessed fp32 logits, before temperature, penalties, min-p, top-k and
      top-p (vLLM's default).

    Stopping:

    - ``max_tokens``: output tokens at most.
    - ``stop_token_ids`` end the request, and so does the model's EOS unless
      ``ignore_eos``; the token stays in ``token_ids`` but its text is left out
      of the output text unless ``include_stop_str_in_output`` (vLLM).
    - ``stop``: strings, matched on the detokenized output text (also across
      token boundaries); the text ends right before the first one found (or
      after it, with ``include_stop_str_in_output``), the finish reason is
      "stop" and ``stop_reason`` the string.
    - ``skip_special_tokens``: leave special tokens out of the text.

    Constraining:

    - ``structured_outputs`` (``StructuredOutputsParams``; None: off): only tokens that
      keep the output an instance of the constraint can be drawn; this mask is applied to
      the logits before anything above (so logprobs are of the masked distribution, -inf
      for the tokens it excludes, as in vLLM).

    Reasoning (thinking models):

    - ``reasoning_markers`` (``ReasoningMarkers``; None: the output is not read for
      reasoning): the engine follows the output through the reasoning block and counts its
      tokens (the markers' own tokens excepted). An output constraint applies from the
      token after the block when the output begins inside one.
    - ``thinking_token_budget`` (None: no limit; needs ``reasoning_markers``): once the
      reasoning has that many tokens, the engine writes ``forced_end`` in place of what
      the model samples, and the answer follows.
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    structured_outputs: StructuredOutputsParams | None = None
    reasoning_markers: ReasoningMarkers | None = None
    thinking_token_budget: int | None = None

    def __post_init__(self) -> None:
        _check_int("n", self.n, minimum=1)
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}.")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}.")
        if self.top_k > TOP_K_MAX:
            raise ValueError(
                f"top_k must be at most {TOP_K_MAX} (any value above the vocabulary size keeps every "
                f"token), got {self.top_k}."
            )
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        _check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        _check_number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 disables it), got {self.repetition_penalty}.")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(name, value)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2] (0 disables it), got {value}.")
        if self.seed is not None:
            _check_int("seed", self.seed)
            # sample i seeds a torch.Generator with seed + i, which must fit in 64 bits
            if not SEED_MIN <= self.seed or self.seed + self.n - 1 > SEED_MAX:
                raise ValueError(
                    f"seed must be in [{SEED_MIN}, {SEED_MAX - self.n + 1}] (with n={self.n}, sample i uses "
                    f"seed + i), got {self.seed}."
                )
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must not exceed max_tokens={self.max_tokens}.")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=0)
        if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids, "__iter__"):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}.")
        self.stop_token_ids = list(self.stop_token_ids)
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids}.")
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {type(self.stop).__name__}.")
        if any(not isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}.")
        if any(s == "" for s in self.stop):
            raise ValueError("stop must not contain an empty string.")
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(
                f"structured_outputs must be a StructuredOutputsParams, got {type(self.structured_outputs).__name__}."
            )
        if isinstance(self.reasoning_markers, dict):
            self.reasoning_markers = ReasoningMarkers(**self.reasoning_markers)
        if self.reasoning_markers is not None and not isinstance(self.reasoning_markers, ReasoningMarkers):
            raise ValueError(
                f"reasoning_markers must be a ReasoningMarkers, got {type(self.reasoning_markers).__name__}."
            )
        if self.thinking_token_budget is not None:
            _check_int("thinking_token_budget", self.thinking_token_budget, minimum=0)
            if self.reasoning_markers is None:
                raise ValueError(
                    "thinking_token_budget needs reasoning_markers: the model's reasoning parser says where its "
                    "reasoning ends (start the server with a --reasoning-parser)."
                )
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}.")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def for_sample(self, index: int) -> SamplingParams:
        """Parameters of sample ``index`` of ``n``: one sequence, seed ``seed + index``;
        prompt logprobs are computed once, by sample 0."""
        if not 0 <= index < self.n:
            raise ValueError(f"Sample index {index} is out of range for n={self.n}.")
        return dataclasses.replace(
            self,
            n=1,
            seed=None if self.seed is None else self.seed + index,
            prompt_logprobs=self.prompt_logprobs if index == 0 else None,
        )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: object, *, minimum: int | None = None) -> None:
    if not _is_int(value):
        raise ValueError(f"{name} must be an integer, got {value!r}.")
    if minimum is not None and value < minimum:  # type: ignore[operator]
        raise ValueError(f"{name} must be at least {minimum}, got {value}.")


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}.")
