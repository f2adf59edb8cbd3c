"""``/v1/completions`` and ``/v1/chat/completions``: from a validated body to the
OpenAI response, whole or as server-sent events."""

from __future__ import annotations

import asyncio
import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from engine.entrypoints.async_engine import AsyncEngine
from engine.entrypoints.errors import APIError, bad_request, refusal
from engine.entrypoints.formatting import ChatFormatter, CompletionFormatter, collect, sse, token_text, usage_of
from engine.entrypoints.generation import Generation, PromptInput, check_text, new_request_id
from engine.entrypoints.metrics import ServerMetrics
from engine.entrypoints.protocol import ChatCompletionRequest, CompletionRequest, NamedToolChoice, _SamplingFields
from engine.entrypoints.tool_calling import ChatTools, OutputReader, ToolChoice, check_tools, openai_arguments
from engine.interfaces.tool_parser import Tool
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


PROMPT_CHARS_PER_TOKEN = 32  # the default character bound: no real prompt has more per token


@dataclass(frozen=True)
class PromptLimits:
    """Bounds on preparing prompts (``ServerConfig``'s): ``max_prompt_chars`` (None: 32 per
    token of the context), ``max_sequences_per_request`` (prompts × n), ``prepare_timeout``
    (seconds to render and tokenize), ``trust_request_chat_template``, ``threads``."""

    max_prompt_chars: int | None = None
    max_sequences_per_request: int = 1024
    prepare_timeout: float = 30.0
    trust_request_chat_template: bool = False
    threads: int = 4


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncEngine,
        metrics: ServerMetrics,
        model_name: str,
        sampling_defaults: dict[str, Any] | None = None,
        chat_tools: ChatTools | None = None,
        limits: PromptLimits | None = None,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.model_name = model_name
        self.model_aliases: frozenset[str] = frozenset()  # other names a request may give the model by
        self.chat_tools = chat_tools or ChatTools(None, None, engine.tokenizer)
        # the checkpoint's generation_config.json settings, for the fields a request leaves out
        self.sampling_defaults = dict(sampling_defaults or {})
        self.limits = limits or PromptLimits()
        # templates are rendered and prompts tokenized here, never on the event loop
        self._prompt_pool = ThreadPoolExecutor(self.limits.threads, thread_name_prefix="engine-prompts")

    async def off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the prompt threads, waited for at most ``limits.prepare_timeout``."""
        future = asyncio.wrap_future(self._prompt_pool.submit(fn, *args))
        try:
            return await asyncio.wait_for(future, timeout=self.limits.prepare_timeout)
        except asyncio.TimeoutError:
            raise bad_request(
                f"Preparing this request's prompt (its chat template and tokenization) took longer than "
                f"{self.limits.prepare_timeout:g} s; shorten it.",
                param="messages",
            ) from None

    @property
    def max_prompt_chars(self) -> int:
        return self.limits.max_prompt_chars or PROMPT_CHARS_PER_TOKEN * self.engine.max_model_len

    def encode(self, text: str, param: str, *, add_special_tokens: bool = True) -> list[int]:
        """``text``'s token ids, refused unread when it is longer than any prompt can be."""
        limit = self.max_prompt_chars
        if len(text) > limit:
            raise bad_request(
                f"{param} has {len(text)} characters; prompts are limited to {limit} (--max-prompt-chars), "
                f"which is already more than this model's context of {self.engine.max_model_len} tokens holds.",
                param=param,
                code="context_length_exceeded",
            )
        tokenizer = self.require_tokenizer("a text prompt")
        return self.check_ids(tokenizer.encode(text, add_special_tokens=add_special_tokens), param)

    # shared checks

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name and model not in self.model_aliases:
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
        self,
        body: _SamplingFields,
        max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        *,
        tool_constraint: StructuredOutputsParams | None = None,
        **extra: Any,
    ) -> SamplingParams:
        """The request's ``SamplingParams``; ``tool_constraint``: the constraint its tool choice
        imposes (refused beside one of its own); ``extra``: further fields (reasoning)."""
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
        except ValueError as exc:
            raise refusal(exc, default_param=constraint_param(body)) from None
        if tool_constraint is not None:
            if fields["structured_outputs"] is not None:
                raise bad_request(
                    f"tool_choice forces a tool call, which is a constraint of its own: drop "
                    f"{constraint_param(body)} or choose tools with 'auto'.",
                    param="tool_choice",
                )
            fields["structured_outputs"] = tool_constraint
        fields.update(extra)
        try:
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
        cap = self.limits.max_sequences_per_request
        if len(items) * body.n > cap:
            raise bad_request(
                f"This request asks for {len(items)} prompts × n={body.n} = {len(items) * body.n} sequences; "
                f"a request may ask for at most {cap} (--max-sequences-per-request). Split it.",
                param="prompt",
            )
        prompts = []
        for item in items:
            if isinstance(item, str):
                text = check_text(item, "prompt")
                if not text:
                    raise bad_request("prompt is empty: give some text or token ids.", param="prompt")
                prompts.append(PromptInput(self.encode(text, "prompt"), text))
            else:
                prompts.append(PromptInput(self.check_ids(list(item), "prompt")))
        return prompts

    async def completions(self, body: CompletionRequest, priority: int) -> tuple[Generation, Callable]:
        self.check_model(body.model)
        prompts = await self.off_loop(self.completion_prompts, body)
        score_only = body.max_tokens == 0  # echo: the prompt scored, nothing generated (one token is, and dropped)
        max_tokens = self.max_tokens(1 if score_only else body.max_tokens, prompts, "max_tokens", "prompt")
        prompt_logprobs = body.prompt_logprobs
        if body.echo and body.logprobs is not None:  # the echoed prompt's tokens carry logprobs too
            prompt_logprobs = max(prompt_logprobs or 0, body.logprobs)
        params = self.sampling_params(body, max_tokens, body.logprobs, prompt_logprobs)
        generation = Generation(
            self.engine, self.metrics, "completions", new_request_id("cmpl"), prompts, params, priority
        )
        generation.constraint_param = constraint_param(body)
        generation.score_only = score_only
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

        def prompt_part(index: int, entries: list[LogprobEntry] | None) -> tuple[str, dict | None, list | None]:
            """What choice ``index`` carries of its prompt: the echoed text, its logprobs (OpenAI's
            shape, when echo and logprobs), and vLLM's ``prompt_logprobs`` (when asked for)."""
            prompt = generation.prompts[index // generation.params.n]
            echoed, echoed_logprobs, vllm = "", None, None
            if body.echo:
                echoed = prompt.text if prompt.text is not None else tokenizer.decode(prompt.token_ids)
                if body.logprobs is not None and entries is not None:
                    tokens = [token_text(tokenizer, t) for t in prompt.token_ids]
                    offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=0))
                    echoed_logprobs = {
                        "tokens": tokens,
                        "token_logprobs": [None, *(e.logprobs[0] for e in entries)],
                        "top_logprobs": [
                            None,
                            *(
                                {
                                    token_text(tokenizer, t): lp
                                    for t, lp in zip(
                                        e.token_ids[1 : 1 + body.logprobs], e.logprobs[1 : 1 + body.logprobs]
                                    )
                                }
                                for e in entries
                            ),
                        ],
                        "text_offset": offsets,
                    }
            if body.prompt_logprobs is not None and entries is not None:
                vllm = [None] + [
                    {
                        str(t): {"logprob": lp, "rank": rank, "decoded_token": token_text(tokenizer, t)}
                        for t, lp, rank in zip(
                            e.token_ids[: 1 + body.prompt_logprobs],
                            e.logprobs[: 1 + body.prompt_logprobs],
                            itertools.chain((e.rank,), range(1, 1 + body.prompt_logprobs)),
                        )
                    }
                    for e in entries
                ]
            return echoed, echoed_logprobs, vllm

        return CompletionFormatter(chunk, choice, logprobs_of, prompt_part, score_only=generation.score_only)

    # /v1/chat/completions

    def chat_messages(self, body: ChatCompletionRequest) -> list[dict]:
        """The conversation as chat templates read it: earlier calls with their arguments as
        objects, each tool result after the call it answers."""
        messages: list[dict] = []
        open_calls: dict[str, str] = {}  # call id -> function name, of calls not answered yet
        for i, message in enumerate(body.messages):
            where = f"messages.{i}"
            text = check_text(message.text(), f"{where}.content")
            entry: dict[str, Any] = {"role": message.role, "content": text}
            reasoning = message.reasoning_content if message.reasoning_content is not None else message.reasoning
            if reasoning is not None:
                entry["reasoning_content"] = check_text(reasoning, f"{where}.reasoning_content")
            if message.role == "assistant":
                open_calls = {}
                if message.tool_calls:
                    calls = []
                    for k, call in enumerate(message.tool_calls):
                        arguments = openai_arguments(
                            call.function.arguments, f"{where}.tool_calls.{k}.function.arguments"
                        )
                        calls.append(
                            {
                                "id": call.id,
                                "type": "function",
                                "function": {"name": call.function.name, "arguments": arguments},
                            }
                        )
                        open_calls[call.id] = call.function.name
                    entry["tool_calls"] = calls
            elif message.role == "tool":
                if message.tool_call_id not in open_calls:
                    raise bad_request(
                        f"{where} answers the tool call {message.tool_call_id!r}, but no assistant message before it "
                        f"made a call with that id that is still unanswered.",
                        param=f"{where}.tool_call_id",
                    )
                entry["tool_call_id"] = message.tool_call_id
                entry["name"] = open_calls.pop(message.tool_call_id)
            else:
                open_calls = {}
            if message.name is not None and message.role != "tool":
                entry["name"] = message.name
            messages.append(entry)
        if not any(m["content"] or m.get("tool_calls") for m in messages):
            raise bad_request("Every message is empty: give some content.", param="messages")
        return messages

    def render_chat(
        self,
        messages: list[dict],
        tools: list[Tool],
        options: dict[str, Any],
        add_generation_prompt: bool = True,
    ) -> PromptInput:
        """The prompt of a conversation: through the model family's chat encoder, else the
        tokenizer's chat template, with the declared tools."""
        tokenizer = self.require_tokenizer("chat")
        declared = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    **({"description": t.description} if t.description is not None else {}),
                    "parameters": t.parameters,
                },
            }
            for t in tools
        ] or None
        encoder = getattr(self.engine, "chat_encoder", None)
        if encoder is not None:  # the model family's own prompt format
            try:
                text = encoder(messages, add_generation_prompt=add_generation_prompt, options=options, tools=declared)
            except ValueError as exc:
                raise bad_request(f"The model's chat format rejected these messages: {exc}", param="messages") from None
            return PromptInput(self.encode(text, "messages", add_special_tokens=False), text)
        if getattr(tokenizer, "chat_template", None) is None:
            raise bad_request("This model has no chat template; use /v1/completions.", param="messages")
        try:
            text = tokenizer.apply_chat_template(
                messages,
                tools=declared,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **options,
            )
        except Exception as exc:  # the template rejects the conversation (roles, order)
            raise bad_request(f"The chat template rejected these messages: {exc}", param="messages") from None
        return PromptInput(self.encode(text, "messages", add_special_tokens=False), text)

    def chat_prompt(self, body: ChatCompletionRequest, tools: list[Tool] | None = None) -> PromptInput:
        options = dict(body.chat_template_kwargs or {})
        if "chat_template" in options and not self.limits.trust_request_chat_template:
            raise bad_request(
                "A chat template sent with the request is not run unless the server is started with "
                "--trust-request-chat-template (a template is code: it can take the server's time and memory).",
                param="chat_template_kwargs.chat_template",
            )
        if body.reasoning_effort is not None:
            options["reasoning_effort"] = body.reasoning_effort
        return self.render_chat(self.chat_messages(body), tools or [], options, body.add_generation_prompt)

    def reasoning_fields(self, prompt: PromptInput, budget: int | None, choice: ToolChoice, param: str) -> dict:
        """The sampling fields a chat request's reasoning and tools need."""
        fields: dict[str, Any] = {}
        markers = self.chat_tools.reasoning_markers(prompt.text)
        if markers is not None:
            fields["reasoning_markers"] = markers
        if budget is not None:
            if markers is None:
                raise bad_request(
                    f"{param} needs a reasoning parser, and this server has none for its model: start it with "
                    f"--reasoning-parser NAME (engine plugins lists them).",
                    param=param,
                )
            fields["thinking_token_budget"] = budget
        if self.chat_tools.needs_special_tokens(choice):
            fields["skip_special_tokens"] = False
        return fields

    async def chat(self, body: ChatCompletionRequest, priority: int) -> tuple[Generation, Callable]:
        self.check_model(body.model)
        cap = self.limits.max_sequences_per_request
        if body.n > cap:  # one prompt × n, bounded as completions' prompts × n are
            raise bad_request(
                f"This request asks for n={body.n} sequences; a request may ask for at most {cap} "
                f"(--max-sequences-per-request).",
                param="n",
            )
        tools = check_tools(
            [(t.function.name, t.function.description, t.function.parameters) for t in body.tools or []], "tools"
        )
        named = body.tool_choice.function.name if isinstance(body.tool_choice, NamedToolChoice) else None
        mode = "named" if named is not None else body.tool_choice
        param = "tool_choice.function.name" if named is not None else "tool_choice"
        choice = self.chat_tools.choice(tools, mode, named, body.parallel_tool_calls, param)
        prompts = [await self.off_loop(self.chat_prompt, body, tools)]
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = self.max_tokens(body.requested_max_tokens, prompts, param, "messages")
        num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        budget_param = "thinking_token_budget" if body.thinking_token_budget is not None else "max_reasoning_tokens"
        params = self.sampling_params(
            body,
            max_tokens,
            num_logprobs,
            tool_constraint=self.chat_tools.constraint(tools, choice, "tool_choice"),
            **self.reasoning_fields(prompts[0], body.reasoning_budget, choice, budget_param),
        )
        generation = Generation(
            self.engine, self.metrics, "chat", new_request_id("chatcmpl"), prompts, params, priority
        )
        generation.constraint_param = "tool_choice" if choice.mode in ("required", "named") else constraint_param(body)
        readers = [self.chat_tools.reader(tools, choice, prompts[0].text) for _ in range(body.n)]
        return generation, self._chat_formatter(body, generation, readers)

    def _chat_formatter(
        self, body: ChatCompletionRequest, generation: Generation, readers: list[OutputReader]
    ) -> Callable:
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

        reasoning = self.chat_tools.reasoning_parser is not None
        return ChatFormatter(chunk, logprobs_of, readers, include_reasoning=body.include_reasoning, reasoning=reasoning)


__all__ = ["OpenAIServing", "collect", "sse", "usage_of"]
