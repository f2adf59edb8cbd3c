"""The built-in demo model ships with the package, runs on the engine as it does in
HF transformers, and has learned English (it is not random weights)."""

from __future__ import annotations

import random

import pytest
import torch

from engine.builtin_models import DEMO_MODEL_DIR, ensure
from engine.sampling_params import SamplingParams

SENTENCE = "Return a list of the words in the string, using sep as the delimiter string."


@pytest.fixture(scope="module")
def demo_llm():
    from engine.llm import LLM

    return LLM("demo", plugins=["cpu", "llama"], dtype="float32", kv_cache_memory=0.05, progress=False)


def test_demo_is_the_packaged_directory():
    assert ensure("demo") == DEMO_MODEL_DIR
    assert (DEMO_MODEL_DIR / "model.safetensors").stat().st_size < 16 * 2**20


def test_demo_greedy_chat_equals_transformers(demo_llm):
    from transformers import AutoModelForCausalLM

    tokenizer = demo_llm.get_tokenizer()
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What does json.dumps do?"}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    output = demo_llm.generate(
        {"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False
    )[0].outputs[0]
    hf = AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()
    with torch.no_grad():
        generated = hf.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False, repetition_penalty=1.0)[
            0, len(ids) :
        ].tolist()
    assert output.token_ids == generated
    assert output.finish_reason == "stop"  # it ends its answer with <|end|>
    assert len(output.text.split()) >= 3


def test_demo_has_learned_english_word_order(demo_llm):
    tokenizer = demo_llm.get_tokenizer()
    words = SENTENCE.split()
    shuffled = words[:]
    random.Random(0).shuffle(shuffled)

    def mean_nll(text: str) -> float:
        ids = tokenizer.encode(text)
        logits = demo_llm.prompt_logits([ids])[0]
        logprobs = torch.log_softmax(logits[:-1], dim=-1)
        return -logprobs.gather(1, torch.tensor(ids[1:])[:, None]).mean().item()

    real, scrambled = mean_nll(SENTENCE), mean_nll(" ".join(shuffled))
    # a model that had not learned English would score both orders alike
    assert real < scrambled - 1.0, (real, scrambled)
    assert real < 6.0  # a uniform guess over the 4096 tokens scores ln(4096) = 8.3
