"""``/v1/completions`` and ``/v1/chat/completions``: from a validated body to the
OpenAI response, whole or as server-sent events."""

from __future__ import annotations

import time
from typing import Any, Callable

from engine.entrypoints.async_engine import AsyncEngine
from engine.entrypoints.errors import APIError, bad_request, refusal
from engine.entrypoints.formatting import ChatFormatter, CompletionFormatter, collect, sse, token_text, usage_of
from engine.entrypoints.generation import Generation, PromptInput, check_text, new_request_id
from engine.entrypoints.metrics import ServerMetrics
from engine.entrypoints.protocol import ChatCompletionRequest, CompletionRequest, _SamplingFields
from engine.runtime.logprobs import LogprobEntry
from engine.sampling_params import SamplingParams, StructuredOutputsParams


def structured_outputs(body: _SamplingFields) -> StructuredOutputsParams | None:
    """The output constraint of ``response_format`` or ``structured_outputs``, or None."""
    if body.structured_outputs is not None:
        so = body.structured_outputs
        return StructuredOutputsParams(
            json=so.json_,
            json_object=so.json_object,
            regex=so.regex,
            choice=so.choice,
            grammar=so.grammar,
            structural_tag=so.structural_tag,
            disable_any_whitespace=so.disable_any_whitespace,
        )
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.type == "structural_tag":
        return StructuredOutputsParams(structural_tag={"structures": fmt.structures, "triggers": fmt.triggers or []})
    schema = fmt.json_schema.schema_
    # OpenAI: a json_schema format without a schema asks for any JSON
    return StructuredOutputsParams(json=schema) if schema is not None else StructuredOutputsParams(json_object=True)


def constraint_param(body: _SamplingFields) -> str | None:
    if body.structured_outputs is not None:
        return "structured_outputs"
    if body.response_format is not None and body.response_format.type != "text":
        return "response_format"
    return None


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncEngine,
        metrics: ServerMetrics,
        model_name: str,
        sampling_defaults: dict[str, Any] | None = None,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.model_name = model_name
        # the checkpoint's generation_config.json settings, for the fields a request leaves out
        self.sampling_defaults = dict(sampling_defaults or {})

    # shared checks

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"The model {model!r} does not exist. This server serves {self.model_name!r}.",
                param="model",
                code="model_not_found",
            )

    def require_tokenizer(self, what: str) -> Any:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise bad_request(
                f"This model has no tokenizer, so {what} is not available; send token ids.", param="prompt"
            )
        return tokenizer

    def check_ids(self, token_ids: list[int], param: str) -> list[int]:
        if not token_ids:
            raise bad_request(f"{param} is empty: give at least one token.", param=param)
        vocab = self.engine.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"{param} holds token ids outside [0, {vocab}): {bad[:5]}.", param=param)
        return token_ids

    def max_tokens(self, requested: int | None, prompts: list[PromptInput], param: str, prompt_param: str) -> int:
        """The request's output limit: ``requested``, checked, or all the room the prompt leaves."""
        limit = self.engine.max_model_len
        longest = max(len(p.token_ids) for p in prompts)
        if longest >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens; the prompt has {longest} tokens, "
                f"which leaves no room for output. Shorten the prompt.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if requested is None:
            return limit - longest
        if requested <= 0:
            raise bad_request(f"{param} must be at least 1, got {requested}.", param=param)
        if longest + requested > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens; the prompt has {longest} tokens and "
                f"{param} asks for {requested} more. Lower {param} to at most {limit - longest}.",
                param=param,
                code="context_length_exceeded",
            )
        return requested

    def sampling_params(
        self, body: _SamplingFields, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        fields: dict[str, Any] = dict(
            n=body.n,
            max_tokens=max_tokens,
            seed=body.seed,
            stop=body.stop,
            stop_token_ids=body.stop_token_ids or [],
            ignore_eos=body.ignore_eos,
            min_tokens=body.min_tokens,
            skip_special_tokens=body.skip_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            value = getattr(body, name)
            if value is None:
                value = self.sampling_defaults.get(name)
            if value is not None:
                fields[name] = value
        if body.min_tokens > max_tokens:
            raise bad_request(f"min_tokens={body.min_tokens} exceeds max_tokens={max_tokens}.", param="min_tokens")
        if body.stop and self.engine.tokenizer is None:
            raise bad_request(
                "stop strings need a tokenizer and this model has none; use stop_token_ids.", param="stop"
            )
        try:
            fields["structured_outputs"] = structured_outputs(body)
            return SamplingParams(**fields)
        except ValueError as exc:
            raise refusal(exc, default_param=constraint_param(body)) from None

    # /v1/completions

    def completion_prompts(self, body: CompletionRequest) -> list[PromptInput]:
        prompt = body.prompt
        if isinstance(prompt, str):
            items: list[Any] = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            items = [list(prompt)]
        else:
            items = list(prompt)
        if not items:
            raise bad_request("prompt is empty.", param="prompt")
        prompts = []
        for item in items:
            if isinstance(item, str):
                text = check_text(item, "prompt")
                if not text:
                    raise bad_request("prompt is empty: give some text or token ids.", param="prompt")
                prompts.append(
                    PromptInput(self.check_ids(self.require_tokenizer("a text prompt").encode(text), "prompt"), text)
                )
            else:
                prompts.append(PromptInput(self.check_ids(list(item), "prompt")))
        return prompts

    async def completions(self, body: CompletionRequest, priority: int) -> tuple[Generation, Callable]:
        self.check_model(body.model)
        prompts = self.completion_prompts(body)
        max_tokens = self.max_tokens(body.max_tokens, prompts, "max_tokens", "prompt")
        params = self.sampling_params(body, max_tokens, body.logprobs, body.prompt_logprobs)
        generation = Generation(
            self.engine, self.metrics, "completions", new_request_id("cmpl"), prompts, params, priority
        )
        generation.constraint_param = constraint_param(body)
        return generation, self._completion_formatter(body, generation)

    def _completion_formatter(self, body: CompletionRequest, generation: Generation) -> Callable:
        created = int(time.time())
        tokenizer = self.engine.tokenizer

        def chunk(choices: list[dict], usage: dict | None = None) -> dict:
            out = {
                "id": generation.request_id,
                "object": "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": choices,
            }
            if usage is not None:
                out["usage"] = usage
            return out

        # token ids ride along when asked for (vLLM's return_token_ids) and always for a model without a
        # tokenizer, whose text is empty
        with_ids = body.return_token_ids or tokenizer is None

        def choice(
            index: int, text: str, logprobs: Any, finish_reason: str | None, stop_reason: Any, token_ids: list[int]
        ) -> dict:
            out = {
                "index": index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
            }
            if with_ids:
                out["token_ids"] = token_ids
                out["prompt_token_ids"] = generation.prompts[index // generation.params.n].token_ids
            return out

        def logprobs_of(entries: list[LogprobEntry] | None, offset: int) -> dict | None:
            if entries is None or body.logprobs is None:
                return None
            tokens, token_logprobs, top, offsets = [], [], [], []
            for entry in entries:
                token = token_text(tokenizer, entry.token_ids[0])
                tokens.append(token)
                token_logprobs.append(entry.logprobs[0])
                top.append({token_text(tokenizer, t): lp for t, lp in zip(entry.token_ids[1:], entry.logprobs[1:])})
                offsets.append(offset)
                offset += len(token)
            return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

        return CompletionFormatter(chunk, choice, logprobs_of)

    # /v1/chat/completions

    def chat_prompt(self, body: ChatCompletionRequest) -> PromptInput:
        tokenizer = self.require_tokenizer("chat")
        messages = []
        for i, message in enumerate(body.messages):
            text = check_text(message.text(), f"messages.{i}.content")
            messages.append({"role": message.role, "content": text})
            if message.reasoning_content is not None:
                messages[-1]["reasoning_content"] = check_text(
                    message.reasoning_content, f"messages.{i}.reasoning_content"
                )
        if not any(m["content"] for m in messages):
            raise bad_request("Every message is empty: give some content.", param="messages")
        options = dict(body.chat_template_kwargs or {})
        if body.reasoning_effort is not None:
            options["reasoning_effort"] = body.reasoning_effort
        encoder = getattr(self.engine, "chat_encoder", None)
        if encoder is not None:  # the model family's own prompt format
            try:
                text = encoder(messages, add_generation_prompt=body.add_generation_prompt, options=options)
            except ValueError as exc:
                raise bad_request(f"The model's chat format rejected these messages: {exc}", param="messages") from None
            return PromptInput(self.check_ids(tokenizer.encode(text, add_special_tokens=False), "messages"), text)
        if getattr(tokenizer, "chat_template", None) is None:
            raise bad_request("This model has no chat template; use /v1/completions.", param="messages")
        try:
            text = tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=body.add_generation_prompt,
                **options,
            )
        except Exception as exc:  # the template rejects the conversation (roles, order)
            raise bad_request(f"The chat template rejected these messages: {exc}", param="messages") from None
        return PromptInput(self.check_ids(tokenizer.encode(text, add_special_tokens=False), "messages"), text)

    async def chat(self, body: ChatCompletionRequest, priority: int) -> tuple[Generation, Callable]:
        self.check_model(body.model)
        prompts = [self.chat_prompt(body)]
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = self.max_tokens(body.requested_max_tokens, prompts, param, "messages")
        num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = self.sampling_params(body, max_tokens, num_logprobs)
        generation = Generation(
            self.engine, self.metrics, "chat", new_request_id("chatcmpl"), prompts, params, priority
        )
        generation.constraint_param = constraint_param(body)
        return generation, self._chat_formatter(body, generation)

    def _chat_formatter(self, body: ChatCompletionRequest, generation: Generation) -> Callable:
        created = int(time.time())
        tokenizer = self.engine.tokenizer

        def chunk(choices: list[dict], usage: dict | None = None, *, stream: bool) -> dict:
            out = {
                "id": generation.request_id,
                "object": "chat.completion.chunk" if stream else "chat.completion",
                "created": created,
                "model": self.model_name,
                "choices": choices,
            }
            if usage is not None:
                out["usage"] = usage
            return out

        def logprobs_of(entries: list[LogprobEntry] | None, offset: int) -> dict | None:
            if entries is None or not body.logprobs:
                return None
            content = []
            for entry in entries:
                token = token_text(tokenizer, entry.token_ids[0])
                content.append(
                    {
                        "token": token,
                        "logprob": entry.logprobs[0],
                        "bytes": list(token.encode("utf-8")),
                        "top_logprobs": [
                            {
                                "token": (t := token_text(tokenizer, tid)),
                                "logprob": lp,
                                "bytes": list(t.encode("utf-8")),
                            }
                            for tid, lp in zip(entry.token_ids[1:], entry.logprobs[1:])
                        ],
                    }
                )
            return {"content": content}

        return ChatFormatter(chunk, logprobs_of)


__all__ = ["OpenAIServing", "collect", "sse", "usage_of"]
