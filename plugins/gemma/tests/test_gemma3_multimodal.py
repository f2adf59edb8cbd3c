"""Gemma 3's multimodal checkpoints (``Gemma3ForConditionalGeneration``) on text prompts, against
transformers' ``Gemma3ForConditionalGeneration`` on the same random weights: the text model's
tensors under the hub's names and under transformers 5's module names, the LM head tied or its
own, the vision tower's and projector's tensors skipped and logged, a published config.json's
sparse ``text_config`` read with transformers' defaults, and the refusals."""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file
from tiny_gemma3 import FULL, SLIDING, TINY_GEMMA3, make_gemma3_multimodal_checkpoint

from engine import LLM
from engine.interfaces.model import ModelInit
from engine.model_config import HFConfig
from engine.testing.generation import random_prompts

PLUGINS = ["gemma", "cpu"]
PROMPT_LENGTHS = (3, 11, 30)  # the window is 8 tokens

# google/gemma-3-4b-it's config.json as published: text_config names only what differs from
# transformers' Gemma3TextConfig defaults
GEMMA3_4B_IT_CONFIG = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "boi_token_index": 255999,
    "eoi_token_index": 256000,
    "eos_token_id": [1, 106],
    "image_token_index": 262144,
    "initializer_range": 0.02,
    "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "torch_dtype": "bfloat16",
    "vision_config": {
        "hidden_size": 1152,
        "image_size": 896,
        "intermediate_size": 4304,
        "model_type": "siglip_vision_model",
        "num_attention_heads": 16,
        "num_hidden_layers": 27,
        "patch_size": 14,
        "vision_use_head": False,
    },
}


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "own-lm-head"])
def checkpoints(request, tmp_path_factory):
    """The same random model saved under both namings: ``{"hub": path, "module": path}``, and it."""
    tied = request.param
    paths = {naming: tmp_path_factory.mktemp(f"gemma3_mm_{naming}") for naming in ("hub", "module")}
    hf_model = make_gemma3_multimodal_checkpoint(paths["hub"], tie_word_embeddings=tied)
    make_gemma3_multimodal_checkpoint(paths["module"], tie_word_embeddings=tied, save_original_format=False)
    return paths, hf_model, tied


def tensor_names(path) -> set[str]:
    return set(load_file(str(path / "model.safetensors")))


@pytest.mark.parametrize("naming", ["hub", "module"])
def test_text_prompt_logits_match_transformers(checkpoints, naming):
    """fp32 logits at every position of text prompts (past the window) are transformers'
    ``Gemma3ForConditionalGeneration``'s within 1e-4 of their magnitude, with the text model's
    tensors named as the hub names them (``language_model.model.*``, ``language_model.lm_head``)
    or as transformers 5's modules (``model.language_model.*``, ``lm_head``)."""
    paths, hf_model, tied = checkpoints
    names = tensor_names(paths[naming])
    # the text model's prefix, the LM head's name, the vision tower's and projector's prefix
    text_prefix, lm_head, vision_prefix = {
        "hub": ("language_model.model.", "language_model.lm_head.weight", ""),
        "module": ("model.language_model.", "lm_head.weight", "model."),
    }[naming]
    vision = tuple(vision_prefix + module for module in ("vision_tower.", "multi_modal_projector."))
    assert all(name.startswith((text_prefix, *vision)) or name == lm_head for name in names)
    assert any(name.startswith(text_prefix) for name in names) and any(name.startswith(vision) for name in names)
    assert (lm_head in names) == (not tied)
    prompts = random_prompts(0, PROMPT_LENGTHS)
    llm = LLM(str(paths[naming]), plugins=PLUGINS, dtype="float32", kv_cache_memory=0.05, progress=False)
    for prompt, logits in zip(prompts, llm.prompt_logits(prompts)):
        with torch.no_grad():
            reference = hf_model(torch.tensor([prompt])).logits[0].float()
        assert logits.shape == reference.shape
        error = (logits - reference).abs().max().item()
        assert error <= 1e-4 * max(1.0, reference.abs().max().item()), f"{len(prompt)} tokens: {error:.3g}"


def test_vision_tensors_are_skipped_and_logged_once(checkpoints, caplog):
    """Every parameter is filled from the text model's tensors; the vision tower's and
    projector's (as many as transformers' modules hold) are left out and counted in one log line."""
    from engine_gemma.gemma3_multimodal import Gemma3ForConditionalGeneration

    paths, hf_model, _ = checkpoints
    vision = [*hf_model.model.vision_tower.state_dict(), *hf_model.model.multi_modal_projector.state_dict()]
    config = HFConfig.from_file(paths["hub"] / "config.json")
    model = Gemma3ForConditionalGeneration(ModelInit(config=config, dtype=torch.float32, device=torch.device("cpu")))
    with caplog.at_level(logging.INFO, logger="engine.gemma"):
        loaded = model.load_weights(iter(load_file(str(paths["hub"] / "model.safetensors")).items()))
    assert {name for name, _ in model.named_parameters()} <= loaded
    messages = [record.getMessage() for record in caplog.records if "vision-tower" in record.getMessage()]
    assert messages == [
        f"Gemma3ForConditionalGeneration: skipped {len(vision)} vision-tower and projector tensors; "
        "the model serves text prompts only"
    ]


def test_published_config_reads_as_transformers_reads_it():
    """gemma-3-4b-it's sparse text_config, built on the meta device: the dimensions, layer kinds,
    window, softmax scale, rope parameters and tied LM head transformers' ``Gemma3Config`` derives."""
    import transformers

    from engine_gemma.gemma3 import rope_parameters_by_layer_type, with_text_defaults
    from engine_gemma.gemma3_multimodal import Gemma3ForConditionalGeneration, text_config

    reference = transformers.Gemma3Config(**GEMMA3_4B_IT_CONFIG).text_config
    model = Gemma3ForConditionalGeneration(
        ModelInit(config=HFConfig(GEMMA3_4B_IT_CONFIG), dtype=torch.bfloat16, device=torch.device("meta"))
    )
    d = model.dims
    assert (d.hidden_size, d.num_heads, d.num_kv_heads, d.head_dim, d.intermediate_size, d.num_layers) == (
        reference.hidden_size,
        reference.num_attention_heads,
        reference.num_key_value_heads,
        reference.head_dim,
        reference.intermediate_size,
        reference.num_hidden_layers,
    )
    assert d.rms_norm_eps == reference.rms_norm_eps
    assert tuple(model.lm_head.weight.shape) == (reference.vocab_size, reference.hidden_size)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as transformers' default
    assert list(model.layer_types) == reference.layer_types
    for spec, kind in zip(model.specs, reference.layer_types):
        assert spec.sliding_window == (reference.sliding_window if kind == SLIDING else None)
        assert spec.scale == reference.query_pre_attn_scalar**-0.5
    assert model.final_logit_softcapping is None
    assert model.rotary[FULL].max_positions == reference.max_position_embeddings
    ours = rope_parameters_by_layer_type(with_text_defaults(text_config(HFConfig(GEMMA3_4B_IT_CONFIG))))
    for kind in (FULL, SLIDING):
        theirs = reference.rope_parameters[kind]
        assert float(ours[kind]["rope_theta"]) == float(theirs["rope_theta"])
        assert ours[kind]["rope_type"] == theirs["rope_type"]
        assert ours[kind].get("factor") == theirs.get("factor")


@pytest.mark.parametrize(
    "config, message",
    [
        (
            {"text_config": {**TINY_GEMMA3, "final_logit_softcapping": 30.0}},
            "final_logit_softcapping 30.0 in text_config",
        ),
        (
            {"text_config": TINY_GEMMA3, "final_logit_softcapping": 30.0},
            "final_logit_softcapping 30.0 in the top level",
        ),
        ({"vision_config": {}}, "has no text_config"),
    ],
    ids=["softcap-in-text-config", "softcap-at-top-level", "no-text-config"],
)
def test_configs_the_model_does_not_implement_are_refused(config, message):
    """transformers' ``Gemma3ForConditionalGeneration`` never caps its logits, whatever
    ``final_logit_softcapping`` says: a config that sets it is refused, as is one without text_config."""
    from engine_gemma.gemma3_multimodal import Gemma3ForConditionalGeneration

    with pytest.raises(ValueError, match=message):
        Gemma3ForConditionalGeneration(
            ModelInit(config=HFConfig(config), dtype=torch.float32, device=torch.device("cpu"))
        )


def test_the_engine_takes_the_fields_a_published_config_leaves_out_from_transformers():
    """gemma-3-4b-it's config.json names no vocabulary size nor context length: the engine's
    setup takes transformers' defaults for them (a vocabulary of 0 would refuse every prompt)."""
    from transformers import Gemma3TextConfig

    from engine.engine.setup import transformers_text_defaults

    defaults = transformers_text_defaults(GEMMA3_4B_IT_CONFIG)
    assert defaults["vocab_size"] == Gemma3TextConfig().vocab_size > 0
    assert defaults["max_position_embeddings"] == Gemma3TextConfig().max_position_embeddings
    assert defaults["hidden_size"] == 2560  # the config's own fields stay
    assert transformers_text_defaults({"model_type": "no-such-model"}) == {}
