"""Per-request state."""

from __future__ import annotations

import enum
import itertools
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


_arrival_counter = itertools.count()


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
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.priority = priority
        self.arrival_time = time.monotonic()
        self.arrival_order = next(_arrival_counter)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []  # chained hashes of the full blocks of token_ids
        self.stop_reason: int | None = None
        self.generator = None  # torch.Generator for seeded sampling, made by the sampler
        self.want_prompt_logits = want_prompt_logits
        self.prompt_logits: list = []  # per-chunk logits tensors when want_prompt_logits

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
    def sort_key(self) -> tuple[int, int]:
        """Scheduling order: lower priority value first, then first come first served."""
        return (self.priority, self.arrival_order)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """Status to finish with after the last appended token, or None to go on."""
        params = self.sampling_params
        last = self.token_ids[-1]
        if (not params.ignore_eos and last in self.eos_token_ids) or last in params.stop_token_ids:
            self.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and self.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
