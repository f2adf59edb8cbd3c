"""What the engine hands back after each step: each request's text (incremental
detokenization), its stop strings, and the bookkeeping of finished requests and of the
samples of ``n > 1`` requests."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.runtime.batch import ModelOutput, StepTimings
from engine.runtime.detokenizer import IncrementalDetokenizer, find_stop_string
from engine.runtime.logprobs import record_sample_logprobs
from engine.runtime.request import Request, RequestStatus


@dataclass
class StepResult:
    """Requests that got a new token this step, those that finished, and the step's
    per-phase timings."""

    updated: list[Request]
    finished: list[Request]
    timings: StepTimings = field(default_factory=StepTimings)


class OutputProcessor:
    """Owns the text of every request (its detokenizer) and the map of requests in flight."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, Request] = {}
        self.request_groups: dict[str, list[Request]] = {}  # n > 1: parent id -> its samples, while any runs

    def in_use(self, request_id: str) -> bool:
        return request_id in self.requests or request_id in self.request_groups

    def add(self, request: Request) -> None:
        params = self.tokenizer is not None and request.sampling_params
        if params:
            hold_back = 0 if params.include_stop_str_in_output else max(map(len, params.stop), default=1) - 1
            request.detokenizer = IncrementalDetokenizer(
                self.tokenizer, skip_special_tokens=params.skip_special_tokens, stop_hold_back=hold_back
            )
        self.requests[request.request_id] = request

    def add_group(self, request_id: str, samples: list[Request]) -> None:
        self.request_groups[request_id] = samples

    def check(self, request: Request, status: RequestStatus | None) -> RequestStatus | None:
        """Detokenize the request's newest token and apply its stop strings; returns the status
        it finishes with (``status``, the one its token ids gave, unless a stop string ends it)."""
        detokenizer, params = request.detokenizer, request.sampling_params
        if detokenizer is None:
            return status
        new_text = ""
        # as in vLLM, the token that stopped the request (EOS, stop_token_ids) stays out of the text
        if status is not RequestStatus.FINISHED_STOPPED or params.include_stop_str_in_output:
            new_text = detokenizer.add_token(request.token_ids[-1])
        if status is not None:
            new_text += detokenizer.flush()
        if params.stop and new_text and request.num_output_tokens > params.min_tokens:
            match = find_stop_string(
                detokenizer.output_text, len(new_text), params.stop, params.include_stop_str_in_output
            )
            if match is not None:
                request.stop_reason, end = match
                detokenizer.truncate(end)
                return RequestStatus.FINISHED_STOPPED
        return status

    def process(self, output: ModelOutput, finished: list[Request]) -> StepResult:
        if output.sample_logprobs is not None:
            record_sample_logprobs(*output.sample_logprobs)
        for request in finished:
            self.forget(request)
        # with async scheduling a step may have computed a token for a request that had finished
        updated = [r for r in output.requests if not r.status.finished or r in finished]
        return StepResult(updated=updated, finished=finished, timings=output.timings)

    def forget(self, request: Request) -> None:
        """Drop a finished or aborted request (and its group once every sample has finished)."""
        self.requests.pop(request.request_id, None)
        parent = request.parent_request_id
        group = self.request_groups.get(parent) if parent else None
        if group is not None and all(r.status.finished for r in group):
            del self.request_groups[parent]
