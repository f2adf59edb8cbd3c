"""Offline batch generation: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import itertools
from typing import Any, Sequence, Union

import torch
from tqdm.auto import tqdm

from engine.config import EngineConfig
from engine.engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput, RequestOutput
from engine.runtime.logprobs import logprob_dict
from engine.runtime.request import Request
from engine.sampling_params import SamplingParams

PromptType = Union[str, list[int], dict[str, Any]]


class LLM:
    """Load a model once and generate for batches of prompts.

    Keyword arguments are the fields of :class:`engine.config.EngineConfig`
    (``plugins``, ``dtype``, ``device``, ``max_model_len``, ``block_size``,
    ``max_num_seqs``, ``max_num_batched_tokens``, ``kv_cache_memory``, ...).
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        progress = kwargs.pop("progress", True)
        self.config = EngineConfig(model=model, **kwargs)
        self.engine = LLMEngine(self.config, progress=progress)
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config: EngineConfig, *, progress: bool = True) -> LLM:
        """An ``LLM`` for settings already validated as an :class:`EngineConfig`."""
        return cls(config.model, progress=progress, **config.model_dump(exclude={"model"}))

    def close(self) -> None:
        """Release the engine: its KV tier and, under tensor parallelism, the other ranks."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def _to_token_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            tokenizer = self.engine.tokenizer
            if tokenizer is None:
                raise ValueError(
                    f"The model at {self.engine.model_path} has no tokenizer; pass token id lists "
                    f"(or {{'prompt_token_ids': [...]}}) instead of text, or give tokenizer=PATH."
                )
            return prompt, tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise TypeError(f"A prompt is a string, a list of token ids or a dict; got {type(prompt).__name__}.")

    def _normalise(self, prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
            return [list(prompts)]
        return list(prompts)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns one :class:`RequestOutput` per prompt, in order."""
        prompt_list = self._normalise(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = (
            [sampling_params] * len(prompt_list)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params_list) != len(prompt_list):
            raise ValueError(f"Got {len(params_list)} SamplingParams for {len(prompt_list)} prompts.")
        groups = self._submit(prompt_list, params_list, want_prompt_logits=False)
        self._run([r for group in groups for r in group], use_tqdm=use_tqdm)
        return [self._output(group) for group in groups]

    def prompt_logits(self, prompts: PromptType | Sequence[PromptType]) -> list[torch.Tensor]:
        """Logits at every prompt position ([len(prompt), vocab] fp32 each): row i
        scores the token that follows prompt token i."""
        prompt_list = self._normalise(prompts)
        params = SamplingParams(temperature=0.0, max_tokens=1)
        groups = self._submit(prompt_list, [params] * len(prompt_list), want_prompt_logits=True)
        self._run([group[0] for group in groups], use_tqdm=False)
        return [torch.cat(group[0].prompt_logits, dim=0) for group in groups]

    def _submit(
        self, prompts: list[PromptType], params: list[SamplingParams], *, want_prompt_logits: bool
    ) -> list[list[Request]]:
        """One group per prompt: its ``n`` sample requests."""
        groups: list[list[Request]] = []
        try:
            for prompt, p in zip(prompts, params):
                text, token_ids = self._to_token_ids(prompt)
                request_id = f"offline-{next(self._ids)}"
                if want_prompt_logits:
                    groups.append(
                        [self.engine.add_request(request_id, token_ids, p, prompt=text, want_prompt_logits=True)]
                    )
                else:
                    groups.append(self.engine.add_request_group(request_id, token_ids, p, prompt=text))
        except BaseException:
            for group in groups:
                for request in group:
                    self.engine.abort(request.request_id)
            raise
        return groups

    def _run(self, requests: list[Request], *, use_tqdm: bool) -> None:
        pending = {r.request_id for r in requests}
        with tqdm(total=len(requests), desc="Generating", unit="req", disable=not use_tqdm, leave=False) as bar:
            try:
                while pending:
                    result = self.engine.step()
                    for request in result.finished:
                        if request.request_id in pending:
                            pending.discard(request.request_id)
                            bar.update(1)
            except BaseException:
                for request_id in pending:
                    self.engine.abort(request_id)
                raise

    def _output(self, group: list[Request]) -> RequestOutput:
        tokenizer = self.engine.tokenizer
        first = group[0]
        prompt_logprobs = None
        if first.sampling_params.prompt_logprobs is not None:
            prompt_logprobs = [None] + [logprob_dict(entry, tokenizer) for entry in first.prompt_logprobs]
        return RequestOutput(
            request_id=first.parent_request_id or first.request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=[self._completion(r) for r in group],
            finished=True,
            prompt_logprobs=prompt_logprobs,
        )

    def _completion(self, request: Request) -> CompletionOutput:
        logprobs = cumulative_logprob = None
        if request.sampling_params.logprobs is not None:
            logprobs = [logprob_dict(entry, self.engine.tokenizer) for entry in request.output_logprobs]
            cumulative_logprob = sum(entry.logprobs[0] for entry in request.output_logprobs)
        return CompletionOutput(
            index=request.index,
            text=request.output_text,
            token_ids=request.output_token_ids,
            finish_reason=request.status.value,
            stop_reason=request.stop_reason,
            logprobs=logprobs,
            cumulative_logprob=cumulative_logprob,
        )
