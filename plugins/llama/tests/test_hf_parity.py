"""engine-llama against HF transformers on the same random weights (fp32)."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams

PROMPT_LENGTHS = [3, 5, 8, 13, 17, 24, 31, 40]

CASES = {
    "llama-gqa": ("LlamaForCausalLM", {}),
    "llama-llama3-rope": (
        "LlamaForCausalLM",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        },
    ),
    "llama-bias-sharded": ("LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True, "max_shard_size": "60KB"}),
    "mistral-sliding-window": ("MistralForCausalLM", {"sliding_window": 8}),
    "qwen2-tied": ("Qwen2ForCausalLM", {}),
    "qwen3-qk-norm": ("Qwen3ForCausalLM", {}),
}


def make_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()


@pytest.fixture(params=sorted(CASES))
def checkpoint(request, tiny_checkpoint):
    architecture, overrides = CASES[request.param]
    return tiny_checkpoint(architecture, **overrides)


def make_llm(path, **kwargs) -> LLM:
    return LLM(str(path), plugins=["cpu", "llama"], dtype="float32", progress=False, kv_cache_memory=0.05, **kwargs)


def test_prefill_logits_match_hf(checkpoint):
    path, hf_model = checkpoint
    llm = make_llm(path)
    prompts = make_prompts(hf_model.config.vocab_size)
    engine_logits = llm.prompt_logits(prompts)  # the 8 prompts run as one varlen batch
    for prompt, logits in zip(prompts, engine_logits):
        with torch.no_grad():
            reference = hf_model(torch.tensor([prompt])).logits[0]
        assert logits.shape == reference.shape
        assert (logits - reference).abs().max().item() < 1e-4


def test_greedy_generation_matches_hf(checkpoint):
    path, hf_model = checkpoint
    llm = make_llm(path)
    prompts = make_prompts(hf_model.config.vocab_size, seed=1)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == prompts
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(hf_model, prompt, 32)


def test_cached_decode_equals_full_recompute(tiny_checkpoint):
    path, hf_model = tiny_checkpoint("LlamaForCausalLM")
    prompts = make_prompts(hf_model.config.vocab_size, seed=2)[2:6]
    llm = make_llm(path)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    sequences = [p + o.outputs[0].token_ids for p, o in zip(prompts, outputs)]
    full = llm.prompt_logits(sequences)  # one prefill over the whole sequence, no cache reuse
    one_at_a_time = make_llm(path, max_num_batched_tokens=1).prompt_logits(sequences)  # every token a cached decode
    for prompt, sequence, recompute, decoded in zip(prompts, sequences, full, one_at_a_time):
        assert (recompute - decoded).abs().max().item() < 1e-4
        # each generated token is the argmax of the recomputed logits at the previous position
        generated = sequence[len(prompt) :]
        assert recompute[len(prompt) - 1 : -1].argmax(dim=-1).tolist() == generated


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_equals_whole_prefill(tiny_checkpoint, chunk):
    path, hf_model = tiny_checkpoint("Qwen3ForCausalLM")
    prompts = make_prompts(hf_model.config.vocab_size, seed=3)
    whole = make_llm(path).prompt_logits(prompts)
    chunked_llm = make_llm(path, max_num_batched_tokens=chunk)
    for a, b in zip(whole, chunked_llm.prompt_logits(prompts)):
        assert (a - b).abs().max().item() < 1e-4
    outputs = chunked_llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(hf_model, prompt, 8)


def test_bfloat16_stays_close_to_fp32_reference(tiny_checkpoint):
    path, hf_model = tiny_checkpoint("LlamaForCausalLM")
    prompts = make_prompts(hf_model.config.vocab_size, seed=4)
    llm = LLM(str(path), plugins=["cpu", "llama"], dtype="bfloat16", progress=False, kv_cache_memory=0.05)
    assert llm.engine.dtype == torch.bfloat16
    for prompt, logits in zip(prompts, llm.prompt_logits(prompts)):
        with torch.no_grad():
            reference = hf_model(torch.tensor([prompt])).logits[0]
        # bf16 keeps 8 bits of mantissa: compare relative to the logits' scale
        assert (logits - reference).abs().max().item() < 0.05 * reference.abs().max().item() + 1e-3


def test_text_prompts_use_the_checkpoint_tokenizer(tiny_checkpoint):
    path, hf_model = tiny_checkpoint("LlamaForCausalLM", with_tokenizer=True)
    llm = make_llm(path)
    tokenizer = llm.get_tokenizer()
    text = "The quick brown fox"
    [output] = llm.generate([text], SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False)
    assert output.prompt == text
    assert output.prompt_token_ids == tokenizer.encode(text)
    assert output.outputs[0].token_ids == hf_greedy(hf_model, tokenizer.encode(text), 10)
    assert output.outputs[0].text == tokenizer.decode(output.outputs[0].token_ids, skip_special_tokens=True)


def test_unknown_checkpoint_tensor_is_an_error(tiny_checkpoint):
    from safetensors.torch import load_file, save_file

    path, _ = tiny_checkpoint("LlamaForCausalLM")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.extra_proj.weight"] = torch.zeros(2, 2)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(KeyError, match="extra_proj"):
        make_llm(path)


def test_missing_checkpoint_tensor_is_an_error(tiny_checkpoint):
    from safetensors.torch import load_file, save_file

    path, _ = tiny_checkpoint("LlamaForCausalLM")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="gate_up_proj"):
        make_llm(path)
