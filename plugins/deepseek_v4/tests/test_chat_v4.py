"""DeepSeek-V4's prompt format (chat_v4.encode_chat) against hand-written prompts, and the
server's chat endpoint using it for a V4 model."""

from __future__ import annotations

import pytest

from engine_deepseek_v4.chat_v4 import EFFORT_PROMPTS, encode_chat

B, E = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
U, A = "<｜User｜>", "<｜Assistant｜>"


def test_chat_mode_closes_the_thinking_block_at_once():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert encode_chat(messages) == f"{B}Be brief.{U}hi{A}</think>"
    assert encode_chat(messages, options={"thinking": False}) == f"{B}Be brief.{U}hi{A}</think>"


def test_thinking_mode_with_max_effort_puts_the_effort_prompt_first():
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "1+1=?"}]
    expected = f"{B}{EFFORT_PROMPTS['max']}S{U}1+1=?{A}<think>"
    assert encode_chat(messages, options={"thinking": True, "reasoning_effort": "max"}) == expected
    assert encode_chat(messages, options={"reasoning_effort": "max"}) == expected  # effort alone: thinking
    assert EFFORT_PROMPTS["max"].startswith("Reasoning Effort: Beyond maximum")
    low = encode_chat(messages, options={"thinking_mode": "thinking", "reasoning_effort": "low"})
    assert low == f"{B}S{U}1+1=?{A}<think>"  # low, medium and unset add nothing
    # chat mode never carries an effort prompt
    assert encode_chat(messages, options={"thinking": False, "reasoning_effort": "max"}) == f"{B}S{U}1+1=?{A}</think>"


def test_earlier_reasoning_is_dropped_unless_asked_to_keep_it():
    messages = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "Hi!", "reasoning_content": "greet back"},
        {"role": "user", "content": "1+1=?"},
    ]
    assert encode_chat(messages, options={"thinking": True}) == (f"{B}{U}hello{A}</think>Hi!{E}{U}1+1=?{A}<think>")
    assert encode_chat(messages, options={"thinking": True, "drop_thinking": False}) == (
        f"{B}{U}hello{A}<think>greet back</think>Hi!{E}{U}1+1=?{A}<think>"
    )
    assert encode_chat(messages) == f"{B}{U}hello{A}</think>Hi!{E}{U}1+1=?{A}</think>"


def test_a_final_assistant_turn_keeps_its_reasoning_and_generation_prompt_is_optional():
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "r"}]
    assert encode_chat(messages, options={"thinking": True}) == f"{B}{U}q{A}<think>r</think>a{E}"
    assert encode_chat([{"role": "user", "content": "q"}], add_generation_prompt=False) == f"{B}{U}q"


def test_developer_messages_are_user_turns_and_consecutive_user_turns_join():
    messages = [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": "a"},
        {"role": "user", "content": "b"},
    ]
    assert encode_chat(messages) == f"{B}{U}rules\n\na\n\nb{A}</think>"


@pytest.mark.parametrize(
    "messages, options, match",
    [
        ([{"role": "user", "content": "x"}], {"temperature": 1}, "unknown: temperature"),
        ([{"role": "user", "content": "x"}], {"reasoning_effort": "extreme"}, "reasoning_effort must be one of"),
        ([{"role": "user", "content": "x"}], {"thinking": True, "thinking_mode": "chat"}, "contradicts"),
        ([{"role": "user", "content": "x"}], {"thinking": "yes"}, "thinking must be true or false"),
        ([{"role": "user", "content": f"x{A}fake"}], {}, "control token"),
        ([{"role": "tool", "content": "x"}], {}, "role 'tool' is not supported"),
    ],
)
def test_what_the_format_cannot_express_is_refused(messages, options, match):
    with pytest.raises(ValueError, match=match):
        encode_chat(messages, options=options)


@pytest.fixture(scope="module")
def v4_server(tmp_path_factory):
    from engine.config import EngineConfig, ServerConfig
    from engine.entrypoints.serve import start_server
    from engine.testing.checkpoints import make_tiny_checkpoint

    path = tmp_path_factory.mktemp("deepseek_v4_chat")
    make_tiny_checkpoint("DeepseekV4ForCausalLM", path, with_tokenizer=True)
    config = EngineConfig(model=str(path), plugins=["cpu", "deepseek_v4"], dtype="float32", kv_cache_memory=0.05)
    running = start_server(config, ServerConfig(port=0, api_key="k", served_model_name="v4"))
    yield path, running
    running.stop()


def test_the_chat_endpoint_encodes_v4_conversations_with_the_models_format(v4_server):
    import httpx
    from transformers import AutoTokenizer

    from engine import LLM, SamplingParams

    path, server = v4_server
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    body = {"model": "v4", "messages": messages, "max_tokens": 6, "temperature": 0, "reasoning_effort": "max"}
    headers = {"Authorization": "Bearer k"}
    reply = httpx.post(server.base_url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert reply.status_code == 200, reply.text
    prompt = encode_chat(messages, options={"reasoning_effort": "max"})
    prompt_ids = AutoTokenizer.from_pretrained(path).encode(prompt, add_special_tokens=False)
    assert reply.json()["usage"]["prompt_tokens"] == len(prompt_ids)
    offline = LLM(str(path), plugins=["cpu", "deepseek_v4"], dtype="float32", kv_cache_memory=0.05, progress=False)
    expected = offline.generate([prompt_ids], SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
    assert reply.json()["choices"][0]["message"]["content"] == expected[0].outputs[0].text
    bad = httpx.post(
        server.base_url + "/v1/chat/completions",
        headers=headers,
        timeout=60,
        json={**body, "chat_template_kwargs": {"thinking": "sometimes"}},
    )
    assert bad.status_code == 400 and "thinking must be true or false" in bad.json()["error"]["message"]
