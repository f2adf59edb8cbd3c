"""The OpenAI-compatible endpoints through the official ``openai`` client, against
the offline ``LLM`` on the same weights."""

from __future__ import annotations

import asyncio
import math

from server_helpers import API_KEY, free_blocks

from engine.sampling_params import SamplingParams

PROMPTS = ["The quick brown fox", "Plugins register platforms", "Hello world! Numbers like 12345"]


def offline_text(offline, prompt, **params):
    params = {"temperature": 0.0, "ignore_eos": True, **params}
    return offline.generate(prompt, SamplingParams(**params), use_tqdm=False)[0].outputs[0]


def chat_ids(offline, messages):
    tokenizer = offline.get_tokenizer()
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def test_completions_greedy_equals_offline(client, offline):
    for prompt in PROMPTS:
        response = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
        )
        expected = offline_text(offline, prompt, max_tokens=12)
        assert response.choices[0].text == expected.text
        assert response.choices[0].finish_reason == "length"
        num_prompt = len(offline.get_tokenizer().encode(prompt))
        assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (num_prompt, 12)
        assert response.usage.total_tokens == num_prompt + 12


def test_completions_token_id_prompt(client, offline):
    response = client.completions.create(
        model="tiny", prompt=[5, 6, 7, 8], max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert response.choices[0].text == offline_text(offline, [5, 6, 7, 8], max_tokens=6).text


def test_batched_prompts_get_one_choice_each_in_order(client, offline):
    response = client.completions.create(
        model="tiny", prompt=PROMPTS[:2], max_tokens=5, temperature=0, n=2, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    for i, choice in enumerate(response.choices):
        assert choice.text == offline_text(offline, PROMPTS[i // 2], max_tokens=5).text


def test_chat_greedy_equals_offline(client, offline):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world!"}]
    response = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    expected = offline_text(offline, chat_ids(offline, messages), max_tokens=10)
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == expected.text
    assert response.usage.prompt_tokens == len(chat_ids(offline, messages))
    assert response.usage.completion_tokens == 10


def test_chat_default_max_tokens_fills_the_context(client, offline):
    messages = [{"role": "user", "content": "Hi"}]
    response = client.chat.completions.create(
        model="tiny", messages=messages, temperature=0, extra_body={"ignore_eos": True}
    )
    assert response.usage.completion_tokens == 256 - len(chat_ids(offline, messages))
    assert response.choices[0].finish_reason == "length"


def test_streaming_text_equals_whole_text(client):
    for stream_options in (None, {"include_usage": True}):
        kwargs = dict(model="tiny", prompt=PROMPTS[0], max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
        whole = client.completions.create(**kwargs)
        extra = {"stream_options": stream_options} if stream_options else {}
        chunks = list(client.completions.create(stream=True, **kwargs, **extra))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == whole.choices[0].text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        if stream_options:
            assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
        else:
            assert all(c.usage is None for c in chunks)


def test_chat_streaming_equals_whole_with_usage(client):
    kwargs = dict(
        model="tiny",
        messages=[{"role": "user", "content": "Tell me about plugins"}],
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 16 == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_n_samples_with_seed_are_reproducible(client):
    kwargs = dict(
        model="tiny",
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=12,
        temperature=1.0,
        n=2,
        seed=1234,
        extra_body={"ignore_eos": True},
    )
    first = client.chat.completions.create(**kwargs)
    second = client.chat.completions.create(**kwargs)
    assert len(first.choices) == 2 and [c.index for c in first.choices] == [0, 1]
    assert [c.message.content for c in first.choices] == [c.message.content for c in second.choices]
    assert first.choices[0].message.content != first.choices[1].message.content  # sample i uses seed + i
    assert first.usage.completion_tokens == 24
    other = client.chat.completions.create(**{**kwargs, "seed": 99})
    assert [c.message.content for c in other.choices] != [c.message.content for c in first.choices]


def test_seeded_sample_equals_offline(client, offline):
    response = client.completions.create(
        model="tiny",
        prompt=PROMPTS[1],
        max_tokens=10,
        temperature=0.8,
        top_p=0.9,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    expected = offline_text(offline, PROMPTS[1], max_tokens=10, temperature=0.8, top_p=0.9, seed=7)
    assert response.choices[0].text == expected.text


def test_completion_logprobs_match_offline(client, offline):
    response = client.completions.create(
        model="tiny", prompt=PROMPTS[2], max_tokens=6, temperature=0, logprobs=3, extra_body={"ignore_eos": True}
    )
    expected = offline_text(offline, PROMPTS[2], max_tokens=6, logprobs=3)
    lp = response.choices[0].logprobs
    tokenizer = offline.get_tokenizer()
    assert lp.tokens == [tokenizer.decode([t]) for t in expected.token_ids]
    for got, want, token_id in zip(lp.token_logprobs, expected.logprobs, expected.token_ids):
        assert math.isclose(got, want[token_id].logprob, abs_tol=1e-4)
    for top, want in zip(lp.top_logprobs, expected.logprobs):
        # keyed by token text, as in OpenAI's format: tokens with the same text share a key
        assert 1 <= len(top) <= 3
        for text, value in top.items():
            assert any(
                math.isclose(value, entry.logprob, abs_tol=1e-4)
                for token_id, entry in want.items()
                if tokenizer.decode([token_id]) == text
            )
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs_match_offline(client, offline):
    messages = [{"role": "user", "content": "Numbers"}]
    response = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    expected = offline_text(offline, chat_ids(offline, messages), max_tokens=5, logprobs=2)
    content = response.choices[0].logprobs.content
    assert len(content) == 5
    for entry, want, token_id in zip(content, expected.logprobs, expected.token_ids):
        assert math.isclose(entry.logprob, want[token_id].logprob, abs_tol=1e-4)
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert bytes(entry.bytes).decode("utf-8") == entry.token


def test_stop_string_cuts_the_text(client, offline):
    full = offline_text(offline, PROMPTS[0], max_tokens=24).text
    stop = full[7:10]  # spans token boundaries in general
    cut = full[: full.index(stop)]
    response = client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    )
    assert response.choices[0].text == cut
    assert response.choices[0].finish_reason == "stop"
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=PROMPTS[0],
            max_tokens=24,
            temperature=0,
            stop=stop,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == cut


def test_models_and_health(client, server):
    import httpx

    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert httpx.get(server.base_url + "/health").json() == {"status": "ok"}


def test_sixty_four_concurrent_streams_all_finish_right(server, offline):
    import openai

    prompts = [f"{PROMPTS[i % 3]} {i}" for i in range(64)]
    expected = [
        o.outputs[0].text
        for o in offline.generate(
            prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False
        )
    ]

    async def one(client, prompt):
        stream = await client.completions.create(
            model="tiny", prompt=prompt, max_tokens=8, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        return "".join([c.choices[0].text async for c in stream])

    async def main():
        async with openai.AsyncOpenAI(
            base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120
        ) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    assert asyncio.run(main()) == expected
    assert free_blocks(server) == server.engine.call(lambda e: e.kv_manager.num_blocks).result(10)


def test_priority_header_reaches_the_scheduler(server):
    import httpx

    recorded = []

    def install(engine):
        original = engine.add_request_group

        def recording(*args, **kwargs):
            recorded.append(kwargs.get("priority"))
            return original(*args, **kwargs)

        engine.add_request_group = recording

    server.engine.call(install).result(10)
    try:
        body = {"model": "tiny", "prompt": "abc", "max_tokens": 3}
        for header, expected in (("-3", -3), ("7", 7), (None, 0)):
            headers = {"Authorization": f"Bearer {API_KEY}"}
            if header is not None:
                headers["X-Request-Priority"] = header
            assert httpx.post(server.base_url + "/v1/completions", json=body, headers=headers).status_code == 200
            assert recorded.pop() == expected
    finally:
        server.engine.call(lambda engine: delattr(engine, "add_request_group")).result(10)


def test_return_token_ids(client, offline):
    response = client.completions.create(
        model="tiny",
        prompt=[5, 6, 7],
        max_tokens=6,
        temperature=0,
        n=2,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    expected = offline_text(offline, [5, 6, 7], max_tokens=6)
    for choice in response.choices:
        assert choice.token_ids == expected.token_ids and choice.prompt_token_ids == [5, 6, 7]
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt="Hello",
            max_tokens=6,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
    )
    streamed = [t for c in chunks for t in c.choices[0].token_ids]
    assert streamed == offline_text(offline, "Hello", max_tokens=6).token_ids
    plain = client.completions.create(model="tiny", prompt="Hello", max_tokens=2, temperature=0)
    assert getattr(plain.choices[0], "token_ids", None) is None
