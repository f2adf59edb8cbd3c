"""Per-request state."""

from __future__ import annotations

import enum
import time

from engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort")


class Request:
    """A prompt and everything generated for it so far.

    ``token_ids`` is prompt + output; ``num_computed_tokens`` of them have their
    K/V in the cache (reset to 0 when the request is preempted, so it is
    recomputed on resumption).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        eos_token_ids: frozenset[int] = frozenset(),
        priority: int = 0,
        prompt: str | None = None,
        want_prompt_logits: bool = False,
        parent_request_id: str | None = None,
        index: int = 0,
        group: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.priority = priority
        self.arrival_time = time.monotonic()
        self.arrival_order: int | None = None  # given by the scheduler when it first takes the request
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.state_slot: int | None = None  # hybrid models: the slot of its recurrent state, while it has blocks
        self.block_hashes: list[bytes] = []  # chained hashes of the full blocks of token_ids
        # (the KV cache manager's cache generation, how many leading blocks of block_ids it has
        # published to the prefix cache): where its next publishing scan starts
        self.published_blocks: tuple[int, int] = (0, 0)
        self.stop_reason: int | str | None = None  # stop token id or stop string
        self.generator = None  # torch.Generator for seeded sampling, made by the sampler
        self.grammar = None  # GrammarMatcher of its structured_outputs constraint, set by the engine
        self.reasoning = None  # ReasoningTracker when its sampling params name reasoning markers
        self.deferred_grammar = None  # the matcher, while the output is in a reasoning block it began in
        self.want_prompt_logits = want_prompt_logits
        self.prompt_logits: list = []  # per-chunk logits tensors when want_prompt_logits
        # sample `index` of the n asked for by `parent_request_id` (None when n == 1)
        self.parent_request_id = parent_request_id
        self.index = index
        # the client request it belongs to (the server's: every prompt and sample of one HTTP
        # request), which the scheduler admits fairly against other groups; None: on its own
        self.group = group
        self.detokenizer = None  # IncrementalDetokenizer, set by the engine when there is a tokenizer
        self.output_logprobs: list = []  # LogprobEntry per output token, when sampling_params.logprobs is set
        self.prompt_logprobs: list = []  # LogprobEntry per prompt token after the first, when prompt_logprobs is set

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def needs_prompt_logits(self) -> bool:
        """Its prompt's logits are read (prompt logprobs, LLM.prompt_logits): every prompt
        position must be computed, so a prefix-cache hit must not skip any."""
        return self.want_prompt_logits or self.sampling_params.prompt_logprobs is not None

    @property
    def output_text(self) -> str:
        return "" if self.detokenizer is None else self.detokenizer.output_text

    def take_output_text_delta(self) -> str:
        """Output text not returned by an earlier call (for streaming)."""
        return "" if self.detokenizer is None else self.detokenizer.take_delta(self.status.finished)

    @property
    def fair_group(self) -> str:
        """What fair admission counts it under: its group, else its samples' parent, else itself."""
        return self.group or self.parent_request_id or self.request_id

    @property
    def sort_key(self) -> tuple[int, int]:
        """Scheduling order: lower priority value first, then first come first served."""
        return (self.priority, self.arrival_order)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """Status to finish with after the last appended token, or None to go on."""
        params = self.sampling_params
        last = self.token_ids[-1]
        may_stop = self.num_output_tokens >= params.min_tokens
        if may_stop and ((not params.ignore_eos and last in self.eos_token_ids) or last in params.stop_token_ids):
            self.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and self.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
