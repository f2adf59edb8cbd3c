"""Disconnects free everything at once; /metrics parses and moves; /v1/messages
speaks the Anthropic shape with the same text as the offline engine."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import API_KEY, free_blocks

from engine.sampling_params import SamplingParams

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
LONG = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 200, "ignore_eos": True}


def running_requests(server) -> int:
    return server.engine.call(lambda engine: len(engine.requests)).result(10)


def wait_until_idle(server, free_before: int, seconds: float) -> float:
    """Seconds until no request runs and the block pool is back to ``free_before``."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        if running_requests(server) == 0 and free_blocks(server) == free_before:
            return time.monotonic() - start
        time.sleep(0.02)
    raise AssertionError(
        f"after {seconds} s: {running_requests(server)} requests still run, "
        f"{free_blocks(server)} free blocks (before: {free_before})"
    )


def test_stream_disconnect_aborts_within_a_second(server):
    free_before = free_blocks(server)
    with httpx.Client(timeout=60) as http:
        with http.stream(
            "POST", server.base_url + "/v1/completions", json={**LONG, "stream": True}, headers=HEADERS
        ) as response:
            lines = response.iter_lines()
            received = [line for line, _ in zip(lines, range(6)) if line.startswith("data:")]
            assert received, "no chunk arrived before the disconnect"
            assert running_requests(server) == 1
            assert free_blocks(server) < free_before
        # leaving the block closes the connection mid-stream
    assert wait_until_idle(server, free_before, 1.0) < 1.0


def test_whole_response_disconnect_aborts_within_a_second(server):
    free_before = free_blocks(server)
    # 4 x 240 tokens take far longer than the 0.1 s the client waits (a step is over a millisecond)
    with httpx.Client(timeout=httpx.Timeout(60, read=0.1)) as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post(server.base_url + "/v1/completions", json={**LONG, "max_tokens": 240, "n": 4}, headers=HEADERS)
    assert wait_until_idle(server, free_before, 1.0) < 1.0


def scrape(server) -> dict[tuple[str, tuple], float]:
    text = httpx.get(server.base_url + "/metrics", headers=HEADERS).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples, name, **labels) -> float:
    key = (name, tuple(sorted({"model_name": "tiny", **labels}.items())))
    return samples.get(key, 0.0)


def test_metrics_parse_and_move(server, client):
    before = scrape(server)
    response = client.completions.create(
        model="tiny", prompt="Hello world", max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    after = scrape(server)

    def moved(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("engine_requests_total", endpoint="completions", status="length") == 1
    assert moved("engine_prompt_tokens_total") == response.usage.prompt_tokens
    assert moved("engine_generation_tokens_total") == 7
    assert moved("engine_time_to_first_token_seconds_count") == 1
    assert moved("engine_e2e_request_latency_seconds_count") == 1
    assert moved("engine_inter_token_latency_seconds_count") == 6
    assert value(after, "engine_num_requests_running") == 0
    assert 0.0 <= value(after, "engine_kv_cache_usage_ratio") <= 1.0
    assert value(after, "engine_prefix_cache_queries_tokens") >= value(before, "engine_prefix_cache_queries_tokens")
    # the same prompt again hits the prefix cache only if it fills a block; the hit rate stays a ratio
    assert 0.0 <= value(after, "engine_prefix_cache_hit_rate") <= 1.0


def test_metrics_count_rejected_requests(server):
    before = scrape(server)
    response = httpx.post(server.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 0}, headers=HEADERS)
    assert response.status_code == 400
    after = scrape(server)
    assert value(after, "engine_requests_total", endpoint="completions", status="400") == (
        value(before, "engine_requests_total", endpoint="completions", status="400") + 1
    )


def anthropic_reference(offline, system, user, max_tokens):
    tokenizer = offline.get_tokenizer()
    conversation = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=False)
    return ids, offline.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0]


def test_messages_whole_and_streamed(server, offline):
    body = {
        "model": "tiny",
        "max_tokens": 9,
        "system": "Be brief.",
        "temperature": 0,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}],
    }
    ids, expected = anthropic_reference(offline, "Be brief.", "Hello", 9)
    headers = {"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}
    whole = httpx.post(server.base_url + "/v1/messages", json=body, headers=headers, timeout=60).json()
    assert whole["type"] == "message" and whole["role"] == "assistant" and whole["model"] == "tiny"
    assert whole["content"] == [{"type": "text", "text": expected.text}]
    assert whole["stop_reason"] == ("max_tokens" if expected.finish_reason == "length" else "end_turn")
    assert whole["usage"] == {"input_tokens": len(ids), "output_tokens": len(expected.token_ids)}

    events, text = [], ""
    with httpx.stream(
        "POST", server.base_url + "/v1/messages", json={**body, "stream": True}, headers=headers, timeout=60
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("event:"):
                events.append(line.split(":", 1)[1].strip())
            elif line.startswith("data:"):
                data = json.loads(line[5:])
                assert data["type"] == events[-1]
                if data["type"] == "content_block_delta":
                    text += data["delta"]["text"]
                if data["type"] == "message_delta":
                    assert data["delta"]["stop_reason"] == whole["stop_reason"]
                    assert data["usage"]["output_tokens"] == whole["usage"]["output_tokens"]
    assert text == expected.text
    assert events[:3] == ["message_start", "content_block_start", "ping"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(events[3:-3]) <= {"content_block_delta"}


def test_messages_stop_sequence(server, offline):
    _, expected = anthropic_reference(offline, "x", "Numbers like 12345", 20)
    full = expected.text
    if len(full) < 6:
        pytest.skip("the random model ended too early to pick a stop sequence")
    stop = full[3:5]
    body = {
        "model": "tiny",
        "max_tokens": 20,
        "system": "x",
        "temperature": 0,
        "stop_sequences": [stop],
        "messages": [{"role": "user", "content": "Numbers like 12345"}],
    }
    reply = httpx.post(server.base_url + "/v1/messages", json=body, headers={"x-api-key": API_KEY}, timeout=60).json()
    assert reply["content"][0]["text"] == full[: full.index(stop)]
    assert (reply["stop_reason"], reply["stop_sequence"]) == ("stop_sequence", stop)


def test_engine_failure_is_a_clean_5xx_and_health_says_so(chat_checkpoint):
    from server_helpers import engine_config

    from engine.config import ServerConfig
    from engine.entrypoints.serve import start_server

    running = start_server(engine_config(chat_checkpoint), ServerConfig(port=0, served_model_name="tiny"))
    try:

        def broken_step():
            raise RuntimeError("secret internal detail")

        running.engine.engine.step = broken_step
        response = httpx.post(running.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=30)
        assert response.status_code == 503
        error = response.json()["error"]
        assert error["type"] == "service_unavailable" and "engine" in error["message"]
        assert "Traceback" not in response.text and "secret internal detail" not in response.text
        assert httpx.get(running.base_url + "/health").status_code == 503
        again = httpx.post(running.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=30)
        assert again.status_code == 503 and "Traceback" not in again.text
    finally:
        running.stop()


def test_generation_config_sets_the_defaults_a_request_leaves_out(chat_checkpoint, tmp_path, offline):
    import shutil

    from server_helpers import engine_config

    from engine.config import ServerConfig
    from engine.entrypoints.serve import start_server

    path = tmp_path / "greedy-by-default"
    shutil.copytree(chat_checkpoint, path)
    (path / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "eos_token_id": 2}))
    greedy = (
        offline.generate(
            "Hello world", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False
        )[0]
        .outputs[0]
        .text
    )
    running = start_server(engine_config(path), ServerConfig(port=0, served_model_name="tiny"))
    try:
        body = {"prompt": "Hello world", "max_tokens": 12, "ignore_eos": True, "n": 2}
        texts = [
            c["text"] for c in httpx.post(running.base_url + "/v1/completions", json=body, timeout=60).json()["choices"]
        ]
        assert texts == [greedy, greedy]
        sampled = httpx.post(
            running.base_url + "/v1/completions", json={**body, "temperature": 1.0, "seed": 3}, timeout=60
        ).json()["choices"]
        assert [c["text"] for c in sampled] != [greedy, greedy]
    finally:
        running.stop()


def test_a_model_without_a_tokenizer_serves_token_ids(tmp_path):
    from server_helpers import engine_config

    from engine.config import ServerConfig
    from engine.entrypoints.serve import start_server
    from engine.testing.checkpoints import make_tiny_checkpoint

    hf_model = make_tiny_checkpoint("LlamaForCausalLM", tmp_path)
    running = start_server(engine_config(tmp_path), ServerConfig(port=0, served_model_name="tiny"))
    try:
        body = {"prompt": [3, 1, 4, 1, 5], "max_tokens": 5, "temperature": 0, "ignore_eos": True}
        choice = httpx.post(running.base_url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
        import torch

        with torch.no_grad():
            expected = hf_model.generate(
                torch.tensor([body["prompt"]]), max_new_tokens=5, min_new_tokens=5, do_sample=False
            )[0, 5:].tolist()
        assert choice["text"] == "" and choice["token_ids"] == expected
        chat = httpx.post(
            running.base_url + "/v1/chat/completions",
            timeout=60,
            json={"messages": [{"role": "user", "content": "hi"}]},
        )
        assert chat.status_code == 400 and "no tokenizer" in chat.json()["error"]["message"]
        text = httpx.post(running.base_url + "/v1/completions", json={**body, "prompt": "words"}, timeout=60)
        assert text.status_code == 400 and "send token ids" in text.json()["error"]["message"]
    finally:
        running.stop()


def test_metrics_show_the_kv_tier_counters(tmp_path):
    from server_helpers import engine_config

    from engine.config import ServerConfig
    from engine.entrypoints.serve import start_server
    from engine.testing.checkpoints import make_tiny_checkpoint

    make_tiny_checkpoint("LlamaForCausalLM", tmp_path)
    # 6 blocks of 16 tokens: the second prompt evicts the first one's prefix into the tier
    config = engine_config(
        tmp_path,
        kv_tier="cpu",
        kv_tier_config={"capacity_gb": 0.01},
        max_model_len=96,
        kv_cache_memory=6 * 16 * 512 / 2**30,
    )  # 512 bytes of KV per token
    running = start_server(config, ServerConfig(port=0, served_model_name="tiny"))
    try:
        for prompt in ([3] * 80, [4] * 80, [3] * 80):
            body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
            assert httpx.post(running.base_url + "/v1/completions", json=body, timeout=60).status_code == 200
        series = {}
        for line in httpx.get(running.base_url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("engine_kv_tier{"):
                series[line.split('counter="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
        assert series["engine_offered_blocks"] >= 4 and series["bytes_written"] > 0
        assert series["engine_prefetched_blocks"] >= 4 and series["loaded_blocks"] >= 4
    finally:
        running.stop()


def test_served_outputs_with_speculation_and_its_metrics(tmp_path):
    """engine serve --speculative-method ngram: greedy completions equal the target's own
    (HF transformers generate) and /metrics shows the drafts and their acceptance."""
    import torch
    from server_helpers import engine_config

    from engine.config import ServerConfig
    from engine.entrypoints.serve import start_server
    from engine.testing.checkpoints import make_tiny_checkpoint

    hf_model = make_tiny_checkpoint("LlamaForCausalLM", tmp_path)
    config = engine_config(tmp_path, speculative_method="ngram", num_speculative_tokens=3)
    running = start_server(config, ServerConfig(port=0, served_model_name="tiny"))
    try:
        for prompt in ([11, 12, 13, 14] * 6, [5, 9, 5, 9, 5, 9, 5]):
            body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
            reply = httpx.post(running.base_url + "/v1/completions", json=body, timeout=60).json()
            with torch.no_grad():
                expected = hf_model.generate(
                    torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False
                )[0, len(prompt) :].tolist()
            assert reply["choices"][0]["token_ids"] == expected
        series = {}
        for line in httpx.get(running.base_url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("engine_spec_decode"):
                name, value = line.rsplit(" ", 1)
                series[name.split("{")[0] + ("[0]" if 'position="0"' in name else "")] = float(value)
        assert series["engine_spec_decode_draft_tokens"] > 0
        assert 0 <= series["engine_spec_decode_accepted_tokens"] <= series["engine_spec_decode_draft_tokens"]
        assert series["engine_spec_decode_acceptance_rate"] == pytest.approx(
            series["engine_spec_decode_accepted_tokens"] / series["engine_spec_decode_draft_tokens"]
        )
        assert "engine_spec_decode_acceptance_rate_by_position[0]" in series
    finally:
        running.stop()
