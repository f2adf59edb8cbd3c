"""Phi-3 against transformers on the same random weights: the conformance kit (partial RoPE;
a sliding window; LongRoPE), prompt logits of a varlen batch, greedy tokens in bf16, cached
decode, the fused qkv_proj / gate_up_proj tensors, and LongRoPE's two frequency sets, the
long one from original_max_position_embeddings on."""

from __future__ import annotations

import json
import math
from typing import Any, ClassVar

import pytest
import torch
from llama_checkpoints import TINY_CONFIGS, TinyModelTests, make_checkpoint
from llama_checks import (
    check_bf16_greedy_tokens,
    check_cached_decode_equals_recompute,
    check_prompt_logits,
    make_llm,
)

from engine.testing.generation import random_prompts

ARCHITECTURE = "Phi3ForCausalLM"
ORIGINAL = 32  # original_max_position_embeddings of the LongRoPE checkpoints: the short factors' span


def longrope(rotary_dim: int) -> dict[str, Any]:
    half = rotary_dim // 2
    return {
        "rope_type": "longrope",
        "rope_theta": 2500.0,
        "short_factor": [1.0 + 0.1 * i for i in range(half)],
        "long_factor": [2.0 + 1.5 * i for i in range(half)],
        "partial_rotary_factor": rotary_dim / 16,
    }


PARTIAL = {"rope_parameters": {"rope_type": "default", "rope_theta": 2500.0, "partial_rotary_factor": 0.5}}
LONGROPE = {"rope_parameters": longrope(8), "original_max_position_embeddings": ORIGINAL}


class TestPhi3Kit(TinyModelTests):
    """RoPE on half of each head (Phi-4-mini turns three quarters), a sliding window shorter
    than the prompts."""

    architecture = ARCHITECTURE
    config_overrides: ClassVar[dict[str, Any]] = {**PARTIAL, "sliding_window": 8}


class TestPhi3LongRopeKit(TinyModelTests):
    """LongRoPE on whole heads; the kit's prompts stay within the short factors' span (its
    cached and prefix checks compare the engine with itself, past that span too)."""

    architecture = ARCHITECTURE
    config_overrides: ClassVar[dict[str, Any]] = {**LONGROPE, "rope_parameters": longrope(16)}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("phi3")
    return path, make_checkpoint(ARCHITECTURE, path, **PARTIAL)


def test_prompt_logits_match_transformers(checkpoint):
    check_prompt_logits(*checkpoint)


def test_checkpoint_stores_qkv_and_gate_up_fused(checkpoint):
    from safetensors import safe_open

    path, _ = checkpoint
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    assert shapes["model.layers.0.self_attn.qkv_proj.weight"] == ((4 + 2 + 2) * 16, 64)
    assert shapes["model.layers.0.mlp.gate_up_proj.weight"] == (2 * 128, 64)
    parts = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
    assert not any(name.split(".")[-2] in parts for name in shapes)


def test_fused_tensor_of_the_wrong_size_is_an_error(checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = checkpoint
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.1.self_attn.qkv_proj.weight"] = torch.zeros(112, 64)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(ValueError, match=r"qkv_proj\.weight: model expects 128 rows \(64 \+ 32 \+ 32\)"):
        make_llm(tmp_path)


def test_bf16_greedy_tokens_match_transformers_for_32_steps(tmp_path):
    check_bf16_greedy_tokens(ARCHITECTURE, tmp_path, **PARTIAL)


def test_cached_decode_equals_recompute(checkpoint):
    check_cached_decode_equals_recompute(checkpoint[0])


@pytest.mark.parametrize("rotary_dim", [16, 8])
def test_longrope_angles_equal_transformers_short_and_long(rotary_dim):
    """Positions before original_max_position_embeddings turn by transformers' short-factor
    frequencies, later ones by its long-factor ones; cos and sin carry its attention factor."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from engine.layers.rotary import RotaryEmbedding

    config = transformers.Phi3Config(
        **{**TINY_CONFIGS[ARCHITECTURE], **LONGROPE, "rope_parameters": longrope(rotary_dim)}
    )
    short, factor = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu")
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=ORIGINAL + 1)
    assert not torch.allclose(short, long)
    rope = RotaryEmbedding(16, 512, {**config.rope_parameters}, rotary_dim=rotary_dim)
    positions = torch.arange(512, dtype=torch.float32)
    expected = torch.cat([torch.outer(positions[:ORIGINAL], short), torch.outer(positions[ORIGINAL:], long)])
    expected = torch.cat([expected, expected], dim=-1)
    assert factor == pytest.approx(math.sqrt(1 + math.log(512 / ORIGINAL) / math.log(ORIGINAL)))
    torch.testing.assert_close(rope.cos, expected.cos() * factor, rtol=0, atol=1e-6)
    torch.testing.assert_close(rope.sin, expected.sin() * factor, rtol=0, atol=1e-6)


def test_longrope_prompt_logits_match_transformers(tmp_path):
    """Prompts within original_max_position_embeddings: the short factors and the attention factor."""
    hf_model = make_checkpoint(ARCHITECTURE, tmp_path, **LONGROPE)
    check_prompt_logits(tmp_path, hf_model, lengths=(3, 9, 16, 32))


def test_longrope_past_the_original_context_matches_transformers_cache(tmp_path):
    """A 48-token sequence fed to transformers' cache one token at a time after a 16-token
    prompt: the prompt's positions turn by the short factors and each new position from 32 on
    by the long ones. The engine's logits over the whole sequence, in one prefill and one token
    a step, are those of every step. (transformers' ``generate`` instead recomputes the sequence
    with the long factors as it passes 32, as one forward over a longer prompt turns every
    position by them: a position's rotation there depends on the sequence's length.)"""
    from transformers import DynamicCache

    hf_model = make_checkpoint(ARCHITECTURE, tmp_path, **LONGROPE)
    sequence = random_prompts(5, (48,), 320)[0]
    cache = DynamicCache(config=hf_model.config)
    with torch.no_grad():
        rows = [hf_model(torch.tensor([sequence[:16]]), cache=cache, use_cache=True).logits[0]]
        for token in sequence[16:]:
            rows.append(hf_model(torch.tensor([[token]]), cache=cache, use_cache=True).logits[0])
    reference = torch.cat(rows)  # [48, vocab]
    with torch.no_grad():
        long_everywhere = hf_model(torch.tensor([sequence])).logits[0]
    assert (long_everywhere[:ORIGINAL] - reference[:ORIGINAL]).abs().max().item() > 1e-3  # the factors matter
    for llm in (make_llm(tmp_path), make_llm(tmp_path, max_num_batched_tokens=1)):
        [logits] = llm.prompt_logits([sequence])
        error = (logits - reference).abs().max().item()
        assert error <= 1e-4 * max(1.0, reference.abs().max().item()), f"logits differ from transformers by {error:.3g}"


def test_legacy_su_rope_scaling_is_longrope(tmp_path):
    """Configs as the first Phi-3 checkpoints wrote them: ``rope_scaling`` of type ``su``, the
    rope base, partial_rotary_factor and original_max_position_embeddings beside it."""
    hf_model = make_checkpoint(ARCHITECTURE, tmp_path, **LONGROPE)
    config = json.loads((tmp_path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope["rope_theta"]
    config["partial_rotary_factor"] = rope["partial_rotary_factor"]
    config["rope_scaling"] = {"type": "su", "short_factor": rope["short_factor"], "long_factor": rope["long_factor"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    check_prompt_logits(tmp_path, hf_model, lengths=(5, 20))


def test_longrope_without_original_context_is_an_error(tmp_path):
    make_checkpoint(ARCHITECTURE, tmp_path, **LONGROPE)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("original_max_position_embeddings")
    config["rope_parameters"].pop("original_max_position_embeddings", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="needs original_max_position_embeddings"):
        make_llm(tmp_path)
