"""What ``LLM.generate`` returns: one ``RequestOutput`` per prompt, in order."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's log probability under the model's raw distribution.

    ``rank`` is 1 + the number of tokens with a strictly higher logprob;
    ``decoded_token`` is the token's text (``tokenizer.decode([id])``), None
    without a tokenizer.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# per position: token id -> Logprob, holding the sampled (or prompt) token and the top-N
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" or "length"; None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it, if any
    logprobs: SampleLogprobs | None = None  # one dict per output token, when logprobs were asked for
    cumulative_logprob: float | None = None  # sum of the output tokens' logprobs, when logprobs were asked for


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    prompt_logprobs: PromptLogprobs | None = None  # first entry None, when prompt_logprobs were asked for
