"""gpt-oss against transformers on the same random weights, beyond the kit: prompts well past the
sliding window in one batch (fp32 logits at every position; the window and the sinks each making
a difference), greedy tokens in bf16, decode one token at a time across the window, the two
KV-cache groups with sinks, and the config's layer list and rope defaults."""

from __future__ import annotations

import pytest
import torch
from tiny_gpt_oss import FULL, SLIDING, TINY_GPT_OSS, make_gpt_oss_checkpoint

from engine import LLM
from engine.model_config import HFConfig
from engine.testing.generation import diverges_only_at_a_near_tie, greedy_tokens, hf_argmax_tokens, random_prompts

PLUGINS = ["gpt_oss", "cpu"]
LONG_PROMPTS = (5, 9, 23, 57)  # the window is 8 tokens


def make_llm(path, dtype: str = "float32", **kwargs) -> LLM:
    return LLM(str(path), plugins=PLUGINS, dtype=dtype, kv_cache_memory=0.05, progress=False, **kwargs)


def hf_logits(hf_model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([prompt])).logits[0].float()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss")
    return path, make_gpt_oss_checkpoint(path)


def test_logits_past_the_window_match_transformers(checkpoint, tmp_path):
    """fp32 logits at every position of a varlen batch of prompts up to seven windows long are
    transformers' within 1e-4 of their magnitude. The same weights with a window wider than the
    prompts, or with sinks that take nothing, give other logits: both are what the comparison checks."""
    path, hf_model = checkpoint
    prompts = random_prompts(0, LONG_PROMPTS)
    for prompt, logits in zip(prompts, make_llm(path).prompt_logits(prompts)):
        reference = hf_logits(hf_model, prompt)
        assert logits.shape == reference.shape
        error = (logits - reference).abs().max().item()
        assert error <= 1e-4 * max(1.0, reference.abs().max().item()), f"{len(prompt)} tokens: {error:.3g}"
    unwindowed = make_gpt_oss_checkpoint(tmp_path / "wide", sliding_window=512)
    assert (hf_logits(unwindowed, prompts[-1]) - hf_logits(hf_model, prompts[-1])).abs().max().item() > 1e-2
    sinkless = make_gpt_oss_checkpoint(tmp_path / "sinkless")
    with torch.no_grad():
        for layer in sinkless.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
    assert (hf_logits(sinkless, prompts[-1]) - hf_logits(hf_model, prompts[-1])).abs().max().item() > 1e-2


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


def test_batch_invariant_mode_matches_transformers(checkpoint):
    """With ``--batch-invariant`` the sinks' layers attend one query token at a time: the logits
    of a batch are still transformers', and each prompt's are bitwise those it gets alone."""
    path, hf_model = checkpoint
    prompts = random_prompts(4, (6, 20))
    llm = make_llm(path, batch_invariant=True)
    together = llm.prompt_logits(prompts)
    for prompt, logits in zip(prompts, together):
        reference = hf_logits(hf_model, prompt)
        assert (logits - reference).abs().max().item() <= 1e-4 * max(1.0, reference.abs().max().item())
        assert torch.equal(llm.prompt_logits([prompt])[0], logits)


def test_bf16_greedy_tokens_match_transformers_for_32_steps(tmp_path):
    """In bf16 transformers takes the attention's softmax in bf16 and the engine in float32, and
    they sum the experts in other orders, so a near tie of a random model's logits may break
    either way: every prompt agrees up to a near tie, and at least two of three agree for all 32."""
    hf_model = make_gpt_oss_checkpoint(tmp_path, dtype="bfloat16")
    prompts = random_prompts(2, (4, 13, 30))
    ours = greedy_tokens(make_llm(tmp_path, dtype="bfloat16"), prompts, 32)
    theirs = [hf_argmax_tokens(hf_model, prompt, 32) for prompt in prompts]
    assert all(diverges_only_at_a_near_tie(hf_model, p, a, b) for p, a, b in zip(prompts, ours, theirs))
    assert sum(a == b for a, b in zip(ours, theirs)) >= 2


def test_sliding_and_full_layers_get_a_kv_cache_group_each_with_sinks(checkpoint):
    path, _ = checkpoint
    groups = make_llm(path).engine.kv_cache.groups
    by_kind = {group.spec.kind: (group.layer_indices, group.spec.sliding_window) for group in groups}
    assert by_kind == {"sliding_window": ([0, 2], 8), "mha": ([1], None)}
    assert all(group.spec.sinks and group.backend.capabilities.sinks for group in groups)


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"rope_theta": 20000.0},
        {"rope_scaling": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512}},
        {"rope_theta": 20000.0, "rope_scaling": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 16.0}},
    ],
    ids=["defaults", "theta", "scaling-without-theta", "theta-and-scaling"],
)
def test_rope_and_layer_types_read_the_config_as_transformers_does(fields):
    """The rope's inverse frequencies and attention factor, and the layer list, from configs that
    leave fields out or give them in the older form, are those transformers derives."""
    import transformers
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    from engine.layers.rotary import inverse_frequencies
    from engine_gpt_oss.gpt_oss import gpt_oss_rope_parameters, layer_types

    sizes = dict(head_dim=16, num_hidden_layers=5, max_position_embeddings=4096)
    reference = transformers.GptOssConfig(**sizes, **fields)
    rotary = GptOssRotaryEmbedding(reference)
    config = HFConfig({**sizes, **fields})
    inv_freq, attention_factor = inverse_frequencies(16, gpt_oss_rope_parameters(config), 4096)
    torch.testing.assert_close(inv_freq, rotary.inv_freq, rtol=1e-6, atol=0)
    assert attention_factor == pytest.approx(rotary.attention_scaling)
    assert list(layer_types(config)) == reference.layer_types


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 of num_local_experts=8"),
        ({"layer_types": [SLIDING, "chunked_attention", FULL]}, r"layer types \['chunked_attention'\]"),
        ({"layer_types": [SLIDING, FULL]}, "2 layer_types for 3 num_hidden_layers"),
        ({"sliding_window": None}, "sets no sliding_window"),
    ],
)
def test_configs_the_model_does_not_implement_are_refused(fields, message):
    from engine.interfaces.model import ModelInit
    from engine_gpt_oss.gpt_oss import GptOssForCausalLM

    config = HFConfig({**TINY_GPT_OSS, **fields})
    with pytest.raises(ValueError, match=message):
        GptOssForCausalLM(ModelInit(config=config, dtype=torch.float32, device=torch.device("cpu")))
