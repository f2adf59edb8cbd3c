"""Reasoning on the chat endpoints: ``reasoning_content`` apart from the answer, usage's
reasoning-token count, and ``thinking_token_budget`` (and Anthropic's ``budget_tokens``)
never exceeded. The model is the scripted one (tests/server/scripted_model.py), whose reply
reasons for longer than the budgets, with ``<think>`` and ``</think>`` as ordinary added
tokens (as Qwen3 has them) and the qwen3 reasoning parser."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
from server_helpers import API_KEY

from engine.builtin_models import DEMO_MODEL_DIR

REQUESTS = 50
ANSWER = " The answer is four."


def _single_token_words(tokenizer, count: int) -> list[str]:
    """Words that are one token each (with their leading space), so that any prefix of the
    reasoning re-encodes to the tokens the model wrote."""
    words = []
    for word in ("the and of to is in it that for on as with be by at this from or an are not was".split()) * 4:
        if len(tokenizer.encode(" " + word, add_special_tokens=False)) == 1:
            words.append(" " + word)
    assert len(words) >= count
    return words[:count]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from scripted_model import make_scripted_checkpoint
    from transformers import AutoTokenizer

    from engine.config import EngineConfig, ServerConfig
    from engine.entrypoints.serve import start_server

    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    reasoning = "".join(_single_token_words(tokenizer, 60))
    script = [("", f"<think>{reasoning}</think>\n\n{ANSWER}")]
    path = make_scripted_checkpoint(
        tmp_path_factory.mktemp("scripted-think"),
        script,
        tokenizer_from=DEMO_MODEL_DIR,
        added_tokens=("<think>", "</think>"),
    )
    config = EngineConfig(
        model=str(path),
        plugins=["cpu", "llama", "scripted_model"],
        dtype="float32",
        kv_cache_memory=0.02,
        reasoning_parser="qwen3",
    )
    running = start_server(config, ServerConfig(port=0, api_key=API_KEY))
    yield running, AutoTokenizer.from_pretrained(path), reasoning
    running.stop()


def _client(running):
    import openai

    return openai.OpenAI(base_url=running.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def test_reasoning_is_apart_from_the_answer(served):
    running, tokenizer, reasoning = served
    with _client(running) as client:
        model = client.models.list().data[0].id
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "2+2?"}], max_tokens=200)
    message = r.choices[0].message
    assert message.reasoning_content == reasoning and message.reasoning == reasoning
    assert message.content == ANSWER and r.choices[0].finish_reason == "stop"
    # usage counts the tokens between the markers, which are the ones reasoning_content holds
    count = len(tokenizer.encode(reasoning, add_special_tokens=False))
    assert r.usage.completion_tokens_details.reasoning_tokens == count == 60


def test_thinking_budget_is_never_exceeded(served):
    import openai

    running, tokenizer, _ = served
    budgets = [random.Random(i).randint(0, 70) for i in range(REQUESTS)]

    async def main():
        async with openai.AsyncOpenAI(base_url=running.base_url + "/v1", api_key=API_KEY, max_retries=0) as client:
            model = (await client.models.list()).data[0].id

            async def one(budget: int):
                return await client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": "2+2?"}],
                    max_tokens=200,
                    extra_body={"thinking_token_budget": budget},
                )

            return await asyncio.gather(*(one(b) for b in budgets))

    for budget, r in zip(budgets, asyncio.run(main())):
        message = r.choices[0].message
        counted = r.usage.completion_tokens_details.reasoning_tokens
        in_text = len(tokenizer.encode(message.reasoning_content, add_special_tokens=False))
        assert counted == in_text == min(budget, 60), (budget, message.reasoning_content)
        assert message.content  # the answer follows the closed reasoning
        assert r.choices[0].finish_reason == "stop"


def test_streamed_reasoning_and_usage(served):
    running, _, reasoning = served
    with _client(running) as client:
        model = client.models.list().data[0].id
        chunks = list(
            client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "2+2?"}],
                max_tokens=200,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"max_reasoning_tokens": 10},
            )
        )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert streamed == reasoning[: len(streamed)] and streamed.count(" ") == 10
    assert "".join(d.content or "" for d in deltas).strip()
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 10


def test_anthropic_thinking_budget(served):
    import anthropic

    running, tokenizer, _ = served
    with anthropic.Anthropic(base_url=running.base_url, api_key=API_KEY, max_retries=0, timeout=60) as client:
        model = _client(running).models.list().data[0].id
        message = client.messages.create(
            model=model,
            max_tokens=200,
            messages=[{"role": "user", "content": "2+2?"}],
            thinking={"type": "enabled", "budget_tokens": 7},
        )
    thinking, text = message.content
    assert thinking.type == "thinking" and len(tokenizer.encode(thinking.thinking, add_special_tokens=False)) == 7
    assert text.type == "text" and text.text


@pytest.fixture(scope="module")
def served_open(tmp_path_factory):
    """The same model under a template that opens the reasoning in the prompt (as Qwen3's
    thinking templates do), replying with reasoning, the closing marker, then plain text."""
    from scripted_model import make_scripted_checkpoint
    from transformers import AutoTokenizer

    from engine.config import EngineConfig, ServerConfig
    from engine.entrypoints.serve import start_server

    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    template = tokenizer.chat_template.replace("<|assistant|>\n", "<|assistant|>\n<think>")
    assert template != tokenizer.chat_template
    reasoning = "".join(_single_token_words(tokenizer, 20))
    path = make_scripted_checkpoint(
        tmp_path_factory.mktemp("scripted-open"),
        [("", f"{reasoning}</think>\n\nnot json at all")],
        tokenizer_from=DEMO_MODEL_DIR,
        chat_template=template,
        added_tokens=("<think>", "</think>"),
    )
    config = EngineConfig(
        model=str(path),
        plugins=["cpu", "llama", "xgrammar", "scripted_model"],
        dtype="float32",
        kv_cache_memory=0.02,
        reasoning_parser="qwen3",
    )
    running = start_server(config, ServerConfig(port=0, api_key=API_KEY))
    yield running, reasoning
    running.stop()


def test_an_output_constraint_starts_after_the_reasoning(served_open):
    running, reasoning = served_open
    schema = {"type": "object", "properties": {"x": {"enum": [1]}}, "required": ["x"], "additionalProperties": False}
    with _client(running) as client:
        model = client.models.list().data[0].id
        r = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "2+2?"}],
            max_tokens=100,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        )
    message = r.choices[0].message
    # the reasoning is the model's own free text; the answer after it is held to the schema
    assert message.reasoning_content == reasoning
    assert json.loads(message.content) == {"x": 1} and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens_details.reasoning_tokens == 20


def test_the_closing_token_a_budget_writes_is_what_logprobs_report(served):
    running, _, reasoning = served
    with _client(running) as client:
        model = client.models.list().data[0].id
        r = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "2+2?"}],
            max_tokens=30,
            logprobs=True,
            extra_body={"thinking_token_budget": 5},
        )
    entries = r.choices[0].logprobs.content
    tokens = [entry.token for entry in entries]
    words = [" " + word for word in reasoning.split(" ")[1:6]]  # the reasoning's first five tokens
    assert tokens[:7] == ["<think>", *words, "</think>"]
    closing = entries[6]
    assert closing.logprob == 0.0  # the only token the engine allowed there
