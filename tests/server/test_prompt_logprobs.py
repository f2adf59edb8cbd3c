"""Prompt logprobs over the API, as evaluation harnesses read them: vLLM's ``prompt_logprobs``
field and OpenAI's ``echo`` with ``logprobs`` (and ``max_tokens: 0``, the prompt scored
alone), against transformers' ``log_softmax`` on the same fp32 checkpoint."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from server_helpers import API_KEY

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def reference(chat_checkpoint):
    """Each prompt token's logprob (after the first) and the model's top tokens there."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_checkpoint)
    model = AutoModelForCausalLM.from_pretrained(chat_checkpoint, torch_dtype=torch.float32)
    ids = tokenizer.encode(PROMPT)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return ids, [logprobs[i - 1, ids[i]].item() for i in range(1, len(ids))], logprobs


def _post(server, **fields):
    body = {"model": "tiny", "prompt": PROMPT, "temperature": 0, **fields}
    r = httpx.post(server.base_url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_scores_the_prompt_alone(server, reference):
    ids, expected, _ = reference
    out = _post(server, echo=True, logprobs=1, max_tokens=0)
    choice = out["choices"][0]
    assert choice["text"] == PROMPT
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) and "".join(logprobs["tokens"]) == PROMPT
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:] == pytest.approx(expected, abs=1e-4)
    assert logprobs["text_offset"][0] == 0 and logprobs["text_offset"][-1] == len(PROMPT) - len(logprobs["tokens"][-1])
    assert out["usage"]["completion_tokens"] == 0 and out["usage"]["prompt_tokens"] == len(ids)


def test_echo_then_the_generated_text(server, reference):
    ids, expected, _ = reference
    out = _post(server, echo=True, logprobs=0, max_tokens=3)
    choice = out["choices"][0]
    assert choice["text"].startswith(PROMPT) and len(choice["text"]) > len(PROMPT)
    assert len(choice["logprobs"]["tokens"]) == len(ids) + 3
    assert choice["logprobs"]["token_logprobs"][1 : len(ids)] == pytest.approx(expected, abs=1e-4)


def test_vllm_prompt_logprobs(server, reference):
    ids, expected, logprobs = reference
    out = _post(server, prompt_logprobs=2, max_tokens=1)
    entries = out["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    for position, (token, entry) in enumerate(zip(ids[1:], entries[1:]), start=1):
        assert entry[str(token)]["logprob"] == pytest.approx(expected[position - 1], abs=1e-4)
        top = torch.topk(logprobs[position - 1], 2)
        for rank, (value, top_id) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
            assert entry[str(top_id)]["logprob"] == pytest.approx(value, abs=1e-4)
            if top_id != token:
                assert entry[str(top_id)]["rank"] == rank


def test_echo_streamed(server):
    body = {"model": "tiny", "prompt": PROMPT, "echo": True, "max_tokens": 2, "stream": True, "temperature": 0}
    text = ""
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += "".join(choice["text"] for choice in json.loads(line[6:])["choices"])
    assert text.startswith(PROMPT) and len(text) > len(PROMPT)
