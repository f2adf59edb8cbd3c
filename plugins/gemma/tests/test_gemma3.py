"""Gemma 3 against transformers on the same random weights, beyond the kit: prompts well past the
sliding window in one batch (fp32 logits at every position, and the window making a difference),
greedy tokens in bf16, decode one token at a time across the window, the two KV-cache groups,
and the config's layer list, rope bases and refusals."""

from __future__ import annotations

import pytest
import torch
from tiny_gemma3 import FULL, SLIDING, TINY_GEMMA3, make_gemma3_checkpoint

from engine import LLM
from engine.model_config import HFConfig
from engine.testing.generation import diverges_only_at_a_near_tie, greedy_tokens, hf_argmax_tokens, random_prompts

PLUGINS = ["gemma", "cpu"]
LONG_PROMPTS = (5, 9, 23, 57)  # the window is 8 tokens


def make_llm(path, dtype: str = "float32", **kwargs) -> LLM:
    return LLM(str(path), plugins=PLUGINS, dtype=dtype, kv_cache_memory=0.05, progress=False, **kwargs)


def hf_logits(hf_model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([prompt])).logits[0].float()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3")
    return path, make_gemma3_checkpoint(path)


def test_logits_past_the_window_match_transformers(checkpoint, tmp_path):
    """fp32 logits at every position of a varlen batch of prompts up to seven windows long are
    transformers' within 1e-4 of their magnitude; the same weights with a window wider than the
    prompts give other logits, so the window is what the comparison checks."""
    path, hf_model = checkpoint
    prompts = random_prompts(0, LONG_PROMPTS)
    for prompt, logits in zip(prompts, make_llm(path).prompt_logits(prompts)):
        reference = hf_logits(hf_model, prompt)
        assert logits.shape == reference.shape
        error = (logits - reference).abs().max().item()
        assert error <= 1e-4 * max(1.0, reference.abs().max().item()), f"{len(prompt)} tokens: {error:.3g}"
    unwindowed = make_gemma3_checkpoint(tmp_path, sliding_window=512)
    assert (hf_logits(unwindowed, prompts[-1]) - hf_logits(hf_model, prompts[-1])).abs().max().item() > 1e-2


def test_decode_across_the_window_matches_transformers(checkpoint):
    """Greedy tokens decoded one step at a time from the cache (short prompts, so most of the 24
    tokens are decoded past the window) are transformers'; every token a separate step (a budget
    of one token) gives the logits of one whole pass."""
    path, hf_model = checkpoint
    prompts = random_prompts(1, (3, 6, 12))
    llm = make_llm(path)
    outputs = greedy_tokens(llm, prompts, 24)
    assert outputs == [hf_argmax_tokens(hf_model, prompt, 24) for prompt in prompts]
    sequences = [p + o for p, o in zip(prompts, outputs)]
    whole = llm.prompt_logits(sequences)
    one_at_a_time = make_llm(path, max_num_batched_tokens=1).prompt_logits(sequences)
    for a, b in zip(whole, one_at_a_time):
        assert (a - b).abs().max().item() <= 1e-4 * max(1.0, a.abs().max().item())


def test_bf16_greedy_tokens_match_transformers_for_32_steps(tmp_path):
    """In bf16 the engine rounds where transformers does not (``1 + weight`` of the norms kept
    in bf16, fused kernels), so a near tie of a random model's logits may break either way:
    every prompt agrees up to a near tie, and at least two of three agree for all 32."""
    hf_model = make_gemma3_checkpoint(tmp_path, dtype="bfloat16")
    prompts = random_prompts(2, (4, 13, 30))
    ours = greedy_tokens(make_llm(tmp_path, dtype="bfloat16"), prompts, 32)
    theirs = [hf_argmax_tokens(hf_model, prompt, 32) for prompt in prompts]
    assert all(diverges_only_at_a_near_tie(hf_model, p, a, b) for p, a, b in zip(prompts, ours, theirs))
    assert sum(a == b for a, b in zip(ours, theirs)) >= 2


def test_local_and_global_layers_get_a_kv_cache_group_each(checkpoint):
    path, _ = checkpoint
    groups = make_llm(path).engine.kv_cache.groups
    by_kind = {group.spec.kind: (group.layer_indices, group.spec.sliding_window) for group in groups}
    assert by_kind == {"sliding_window": ([0, 2, 3], 8), "mha": ([1], None)}
    assert all(group.spec.scale == 24**-0.5 for group in groups)  # query_pre_attn_scalar, not head_dim


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"sliding_window_pattern": 3, "num_hidden_layers": 7},
        {"rope_theta": 5000.0, "rope_local_base_freq": 700.0, "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
        {"rope_theta": 5000.0},
    ],
    ids=["defaults", "pattern", "old-rope-fields", "global-theta-only"],
)
def test_layer_types_and_rope_bases_read_the_config_as_transformers_does(fields):
    """Configs in the older form (no ``layer_types``, rope fields of their own) give the layer
    list and per-type rope parameters transformers derives from them."""
    import transformers

    from engine_gemma.gemma3 import layer_types, rope_parameters_by_layer_type

    reference = transformers.Gemma3TextConfig(**fields)
    config = HFConfig(fields)
    assert list(layer_types(HFConfig({"num_hidden_layers": reference.num_hidden_layers, **fields}))) == (
        reference.layer_types
    )
    ours = rope_parameters_by_layer_type(config)
    for kind in (FULL, SLIDING):
        theirs = reference.rope_parameters[kind]
        assert float(ours[kind]["rope_theta"]) == float(theirs["rope_theta"])
        assert ours[kind]["rope_type"] == theirs["rope_type"]
        assert ours[kind].get("factor") == theirs.get("factor")


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"hidden_activation": "silu"}, "computes the tanh GELU"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping 50.0"),
        ({"use_bidirectional_attention": True}, "causal attention only"),
        ({"layer_types": [SLIDING, "chunked_attention", SLIDING, SLIDING]}, r"layer types \['chunked_attention'\]"),
        ({"layer_types": [SLIDING, FULL]}, "2 layer_types for 4 num_hidden_layers"),
    ],
)
def test_configs_the_model_does_not_implement_are_refused(fields, message):
    from engine.interfaces.model import ModelInit
    from engine_gemma.gemma3 import Gemma3ForCausalLM

    config = HFConfig({**TINY_GEMMA3, **fields})
    with pytest.raises(ValueError, match=message):
        Gemma3ForCausalLM(ModelInit(config=config, dtype=torch.float32, device=torch.device("cpu")))
