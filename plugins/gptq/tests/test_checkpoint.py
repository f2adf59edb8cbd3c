"""GPTQ checkpoints through the engine: a tiny Llama quantized into the GPTQ format by the
plugin's round-to-nearest, saved with its quantization_config, loaded and run quantized.

The reference is the same Llama with every linear weight replaced by its GPTQ weight
dequantized by gptq_reference.py, loaded unquantized: the two models hold the same
weights (rounded to the compute dtype), so their logits differ only by the order of the
float32 sums.
"""

from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pytest
import torch
from gptq_reference import dequantize
from safetensors.torch import load_file, save_file

from engine import LLM
from engine.bench.roofline import weight_bytes
from engine.interfaces.group_quant import GroupQuantWeight
from engine.testing.checkpoints import make_tiny_checkpoint
from engine_gptq.quantizer import GptqQuantizer

PLUGINS = ["cpu", "llama", "gptq"]
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SETTINGS = {"bits": 4, "group_size": 32, "sym": False, "desc_act": True, "checkpoint_format": "gptq"}
HELD_NAMES = ("qweight", "scales", "offsets", "input_order")
# largest |gptq − dequantized| over the logits, relative to the largest |logit|: the quantized layers
# compute the float32 weight, the dense model the weight rounded to its dtype. Measured 1.6e-2 in
# bfloat16 (the weights' bfloat16 rounding, carried through the bfloat16 layers); float32 agrees
# to the order of the float32 sums
TOLERANCE = {"float32": 1e-5, "bfloat16": 3e-2}


def write_checkpoint(base, path, tensors: dict, quantization_config: dict | None) -> None:
    path.mkdir()
    for name in ("config.json", "generation_config.json"):
        shutil.copy(base / name, path / name)
    if quantization_config is not None:
        config = json.loads((base / "config.json").read_text())
        config["quantization_config"] = quantization_config
        (path / "config.json").write_text(json.dumps(config))
    save_file({name: t.contiguous() for name, t in tensors.items()}, path / "model.safetensors", {"format": "pt"})


def gptq_checkpoints(root, settings: dict, modules: tuple[str, ...] = LINEAR, **overrides):
    """(a tiny bf16 Llama, its GPTQ checkpoint with ``modules`` quantized by the plugin's
    round-to-nearest, those GPTQ weights dequantized by gptq_reference.py, unquantized)."""
    make_tiny_checkpoint(
        "LlamaForCausalLM",
        root / "base",
        dtype="bfloat16",
        initializer_range=0.1,
        hidden_size=128,
        intermediate_size=256,
        **overrides,
    )
    state = load_file(root / "base" / "model.safetensors")
    quantizer = GptqQuantizer.from_config(settings, prequantized=False)
    quantized, dequantized = {}, {}
    for name, tensor in state.items():
        module = name.removesuffix(".weight")
        if module.split(".")[-1] not in modules:
            quantized[name] = dequantized[name] = tensor
            continue
        gptq = quantizer.export_weight(tensor, None)
        quantized.update({f"{module}.{key}": value for key, value in gptq.items()})
        numpy_tensors = {key: value.numpy() for key, value in gptq.items()}
        dequantized[name] = torch.from_numpy(dequantize(numpy_tensors, settings["bits"])).float()
    write_checkpoint(root / "base", root / "gptq", quantized, {"quant_method": "gptq", **settings})
    write_checkpoint(root / "base", root / "dequantized", dequantized, None)
    return root / "base", root / "gptq", root / "dequantized"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(bf16 checkpoint, its GPTQ checkpoint, the GPTQ weights dequantized, unquantized)."""
    return gptq_checkpoints(tmp_path_factory.mktemp("gptq"), SETTINGS)


def make_llm(path, dtype: str, **kwargs) -> LLM:
    return LLM(str(path), plugins=PLUGINS, dtype=dtype, progress=False, kv_cache_memory=0.05, **kwargs)


def make_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 320) for _ in range(n)] for n in (3, 11, 25)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logits_match_the_dequantized_model(checkpoints, dtype):
    _, gptq, dequantized = checkpoints
    llm = make_llm(gptq, dtype)
    down = llm.engine.model.model.layers[0].mlp.down_proj
    assert not hasattr(down, "weight") and not hasattr(down, "qzeros"), "the layer keeps more than its weight"
    [(_, _, weight)] = down.group_quant
    assert isinstance(weight, GroupQuantWeight) and down.qweight.dtype == torch.uint8 and weight.qweight is down.qweight
    assert weight.input_order is not None, "act-order: the inputs are gathered by group"
    prompts = make_prompts(0)
    for got, want in zip(llm.prompt_logits(prompts), make_llm(dequantized, dtype).prompt_logits(prompts)):
        error = (got.float() - want.float()).abs().max().item() / want.float().abs().max().item()
        assert error <= TOLERANCE[dtype], f"{dtype}: relative logit difference {error:.2e}"


def test_resident_weights_are_a_fraction_of_bf16(checkpoints):
    """The bytes a decode step reads (``engine bench``'s weight_bytes): the 4-bit linear
    layers hold about 40% of their bfloat16 bytes (weights 25%, a float32 scale and offset per
    32 weights 12.5%, an int64 input order per shard 3%, much for this model's 128 inputs); the
    whole model, with its unquantized head, under half."""
    base, gptq, _ = checkpoints
    quantized, dense = make_llm(gptq, "bfloat16").engine.model, make_llm(base, "bfloat16").engine.model

    def linear_bytes(model) -> int:
        layers = [m for m in model.model.layers.modules() if hasattr(m, "method")]
        return sum(p.numel() * p.element_size() for layer in layers for p in layer.parameters())

    assert linear_bytes(quantized) <= 0.41 * linear_bytes(dense), (linear_bytes(quantized), linear_bytes(dense))
    assert weight_bytes(quantized) <= 0.5 * weight_bytes(dense), (weight_bytes(quantized), weight_bytes(dense))


def test_quantizing_while_loading_matches_the_prequantized_checkpoint(checkpoints):
    """--quantization gptq on the bf16 checkpoint holds the very weights of the GPTQ checkpoint."""
    base, gptq, _ = checkpoints
    on_the_fly = make_llm(base, "bfloat16", quantization="gptq", quantization_config=SETTINGS)
    prequantized = make_llm(gptq, "bfloat16")

    def held_tensors(llm) -> dict:
        params = llm.engine.model.named_parameters()
        return {name: p for name, p in params if name.split(".")[-1].startswith(HELD_NAMES)}

    expected, got = held_tensors(prequantized), held_tensors(on_the_fly)
    # 2 layers of qkv (3 shards, each its own act-order), o, gate_up (2 shards), down: a qweight,
    # scales, offsets and input_order each
    assert len(expected) == 2 * 4 * (3 + 1 + 2 + 1) and sorted(got) == sorted(expected)
    assert "model.layers.0.self_attn.qkv_proj.input_order_2" in expected
    for name, param in expected.items():
        assert torch.equal(param, got[name]), name
    prompts = make_prompts(1)
    for a, b in zip(on_the_fly.prompt_logits(prompts), prequantized.prompt_logits(prompts)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bits", [2, 3])
def test_unsupported_bit_width_fails_at_start(checkpoints, tmp_path, bits):
    _, gptq, _ = checkpoints
    path = tmp_path / f"gptq-{bits}bit"
    shutil.copytree(gptq, path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["bits"] = bits
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as failure:
        make_llm(path, "bfloat16")
    message = str(failure.value)
    assert f"bits={bits}" in message and "4-bit and 8-bit" in message, message


def test_export_round_trips_through_numpy(checkpoints):
    """The saved qweight words are those export_weight returned (no dtype change on the way)."""
    _, gptq, _ = checkpoints
    saved = load_file(gptq / "model.safetensors")
    words = saved["model.layers.0.mlp.down_proj.qweight"]
    assert words.dtype == torch.int32 and words.shape == (256 * 4 // 32, 128)
    assert np.array_equal(np.sort(saved["model.layers.0.mlp.down_proj.g_idx"].numpy()), np.arange(256) // 32)


def test_bits_that_do_not_match_the_tensors_name_their_shapes(checkpoints, tmp_path):
    """A 4-bit checkpoint whose config says 8 bits: loading names the tensor, its shape and the one expected."""
    _, gptq, _ = checkpoints
    path = tmp_path / "gptq-mislabelled"
    shutil.copytree(gptq, path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["bits"] = 8
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"qweight is \(16, 128\) torch.int32; a 8-bit layer .* expects \(32, 128\)"):
        make_llm(path, "bfloat16")


@pytest.mark.parametrize(
    "settings,message",
    [
        ({"bits": 3}, r"bits=3 \(--quantization-config\) is not supported: engine-gptq computes 4-bit and 8-bit"),
        ({"group": 64}, r"Unknown GPTQ --quantization-config key\(s\): group\. Known: bits, checkpoint_format"),
        ({"group_size": 0}, r"group_size must be -1 or a positive integer, got 0"),
        ({"checkpoint_format": "marlin"}, r"checkpoint_format 'marlin' .* reads gptq and gptq_v2"),
    ],
)
def test_quantizing_while_loading_refuses_bad_settings(checkpoints, settings, message):
    base, _, _ = checkpoints
    with pytest.raises(ValueError, match=message):
        make_llm(base, "bfloat16", quantization="gptq", quantization_config=settings)


# a quantization_config as AutoGPTQ / optimum write it: keys this plugin does not need are ignored
AUTOGPTQ_CONFIG = {
    "quant_method": "gptq",
    "bits": 4,
    "group_size": 128,
    "damp_percent": 0.01,
    "desc_act": True,
    "static_groups": False,
    "sym": True,
    "true_sequential": True,
    "model_name_or_path": None,
    "model_file_base_name": "model",
    "checkpoint_format": "gptq",
}


@pytest.mark.parametrize(
    "change,message",
    [
        ({}, None),
        ({"checkpoint_format": None, "format": "gptq_v2"}, None),
        ({"bits": 2}, r"bits=2 \(the checkpoint's quantization_config\) is not supported"),
        ({"is_marlin_format": True}, r"checkpoint_format 'gptq' .* is not supported"),
        ({"checkpoint_format": "marlin"}, r"checkpoint_format 'marlin' .* reads gptq and gptq_v2"),
        ({"pack_dtype": "int16"}, r"pack_dtype 'int16' is not supported; only int32"),
        ({"lm_head": "yes"}, r"lm_head must be true or false, got 'yes'"),
        ({"dynamic": {"-:.*down_proj": {}}}, r"per-module overrides \(dynamic\)"),
        ({"sym": "yes"}, r"sym must be true or false, got 'yes'"),
    ],
)
def test_checkpoint_settings(change, message):
    config = {key: value for key, value in {**AUTOGPTQ_CONFIG, **change}.items() if value is not None}
    if message is None:
        settings = GptqQuantizer.from_config(config, prequantized=True).settings
        assert (settings.bits, settings.group_size, settings.sym, settings.desc_act) == (4, 128, True, True)
        assert settings.zeros_minus_one == (config.get("checkpoint_format", config.get("format")) == "gptq")
        return
    with pytest.raises(ValueError, match=message):
        GptqQuantizer.from_config(config, prequantized=True)


@pytest.fixture(scope="module")
def head_checkpoints(tmp_path_factory):
    """An untied Llama and its GPTQ checkpoint with ``lm_head: true`` (GPTQModel's option): the
    output head quantized too; and that checkpoint dequantized."""
    root = tmp_path_factory.mktemp("gptq-head")
    found = gptq_checkpoints(root, {**SETTINGS, "lm_head": True}, (*LINEAR, "lm_head"), tie_word_embeddings=False)
    assert "lm_head.qweight" in load_file(found[1] / "model.safetensors")
    return found


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_quantized_lm_head_runs_from_its_packed_weight(head_checkpoints, dtype):
    base, gptq, dequantized = head_checkpoints
    llm = make_llm(gptq, dtype)
    head = llm.engine.model.lm_head
    assert not hasattr(head, "weight") and head.qweight.dtype == torch.uint8, "the head holds a dense weight"
    prompts = make_prompts(2)
    for got, want in zip(llm.prompt_logits(prompts), make_llm(dequantized, dtype).prompt_logits(prompts)):
        error = (got.float() - want.float()).abs().max().item() / want.float().abs().max().item()
        assert error <= TOLERANCE[dtype], f"{dtype}: relative logit difference {error:.2e}"
    # quantizing while loading with lm_head gives the very same head
    on_the_fly = make_llm(base, dtype, quantization="gptq", quantization_config={**SETTINGS, "lm_head": True})
    assert torch.equal(on_the_fly.engine.model.lm_head.qweight, head.qweight)
    assert on_the_fly.engine.quantizer.checkpoint_config()["lm_head"] is True


def test_a_tied_head_is_not_quantized_by_lm_head(tmp_path):
    """lm_head: true on a model whose head is its embedding: refused at start, naming the head."""
    make_tiny_checkpoint("LlamaForCausalLM", tmp_path / "tied", hidden_size=128, tie_word_embeddings=True)
    with pytest.raises(ValueError, match="lm_head, whose weight is tied to model.embed_tokens"):
        make_llm(tmp_path / "tied", "bfloat16", quantization="gptq", quantization_config={**SETTINGS, "lm_head": True})
