"""Checks the Qwen3-MoE, Mixtral and Phi-3 tests share: logits and greedy tokens against
transformers on the same random weights, cached decode against recompute, and a checkpoint's
per-expert tensors rewritten in transformers 5's stacked layout."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
from llama_checkpoints import make_checkpoint

from engine import LLM
from engine.testing.generation import diverges_only_at_a_near_tie, greedy_tokens, hf_argmax_tokens, random_prompts

PROMPT_LENGTHS = (3, 5, 8, 13, 17, 24, 31, 40)
RTOL = 1e-4  # fp32 logits, relative to their magnitude when above 1


def make_llm(path: Path, dtype: str = "float32", **kwargs: Any) -> LLM:
    return LLM(str(path), plugins=["cpu", "llama"], dtype=dtype, progress=False, kv_cache_memory=0.05, **kwargs)


def check_prompt_logits(path: Path, hf_model: Any, lengths=PROMPT_LENGTHS, **llm_kwargs: Any) -> LLM:
    """The logits at every position of prompts of ``lengths`` tokens, run as one varlen batch,
    equal transformers' forward of each prompt within RTOL; returns the engine."""
    llm = make_llm(path, **llm_kwargs)
    prompts = random_prompts(0, lengths, hf_model.config.vocab_size)
    for prompt, logits in zip(prompts, llm.prompt_logits(prompts)):
        with torch.no_grad():
            reference = hf_model(torch.tensor([prompt])).logits[0]
        assert logits.shape == reference.shape
        error = (logits - reference).abs().max().item()
        assert error <= RTOL * max(1.0, reference.abs().max().item()), (
            f"prompt of {len(prompt)} tokens: logits differ from transformers by {error:.3g}"
        )
    return llm


def check_bf16_greedy_tokens(architecture: str, path: Path, **overrides: Any) -> None:
    """32 greedy tokens of three prompts in bf16 are transformers' (its bf16 argmax over each
    growing sequence), up to a near tie that rounding may break either way."""
    hf_model = make_checkpoint(architecture, path, dtype="bfloat16", **overrides)
    llm = make_llm(path, dtype="bfloat16")
    assert llm.engine.dtype == torch.bfloat16
    prompts = random_prompts(4, (6, 17, 29), hf_model.config.vocab_size)
    ours = greedy_tokens(llm, prompts, 32)
    theirs = [hf_argmax_tokens(hf_model, prompt, 32) for prompt in prompts]
    assert all(diverges_only_at_a_near_tie(hf_model, p, a, b) for p, a, b in zip(prompts, ours, theirs))


def check_cached_decode_equals_recompute(path: Path, vocab_size: int = 320) -> None:
    """24 greedy tokens decoded with the KV cache are the argmax of one uncached pass over prompt
    + output, and feeding every token as a cached decode step gives that pass's logits."""
    prompts = random_prompts(2, (5, 9, 16), vocab_size)
    llm = make_llm(path)
    sequences = [p + t for p, t in zip(prompts, greedy_tokens(llm, prompts, 24))]
    recomputed = llm.prompt_logits(sequences)  # one prefill over each whole sequence
    one_at_a_time = make_llm(path, max_num_batched_tokens=1).prompt_logits(sequences)  # every token a decode step
    for prompt, sequence, full, decoded in zip(prompts, sequences, recomputed, one_at_a_time):
        assert (full - decoded).abs().max().item() <= RTOL * max(1.0, full.abs().max().item())
        assert full[len(prompt) - 1 : -1].argmax(dim=-1).tolist() == sequence[len(prompt) :]


PER_EXPERT = re.compile(r"(?P<moe>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def stack_experts(source: Path, target: Path, canonical: Callable[[str], str]) -> None:
    """Copy the checkpoint at ``source`` to ``target`` with each layer's experts stacked as
    transformers 5 holds them: ``mlp.experts.gate_up_proj`` [E, 2I, hidden] (expert e's gate
    rows, then its up rows) and ``mlp.experts.down_proj`` [E, hidden, I]. ``canonical`` names
    a checkpoint tensor as transformers 5 does (``...mlp.experts.E.gate_proj.weight``)."""
    from safetensors.torch import load_file, save_file

    tensors = {canonical(name): tensor for name, tensor in load_file(source / "model.safetensors").items()}
    experts: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    stacked = {}
    for name, tensor in tensors.items():
        match = PER_EXPERT.match(name)
        if match:
            experts.setdefault(match["moe"], {})[(int(match["expert"]), match["proj"])] = tensor
        else:
            stacked[name] = tensor
    assert experts, "the checkpoint has no per-expert tensors to stack"
    for moe, parts in experts.items():
        count = 1 + max(e for e, _ in parts)
        stacked[f"{moe}.gate_up_proj"] = torch.stack(
            [torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]]) for e in range(count)]
        )
        stacked[f"{moe}.down_proj"] = torch.stack([parts[(e, "down_proj")] for e in range(count)])
    target.mkdir(parents=True, exist_ok=True)
    save_file(stacked, target / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(source / "config.json", target / "config.json")
