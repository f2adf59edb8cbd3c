"""The mxfp8 quantizer: its configuration, its checkpoint tensors, and a tiny Llama served
by the engine with MXFP8 weights (quantized while loading, and from a prequantized
checkpoint) against transformers' model with the same weights dequantized."""

from __future__ import annotations

import json
import logging
import random
import shutil

import pytest
import torch

from engine.layers.linear import MergedLinear
from engine_xpu.mxfp8 import mxfp8_dequantize, mxfp8_quantize
from engine_xpu.quantizer import Mxfp8LinearMethod, Mxfp8Quantizer

E8M0 = getattr(torch, "float8_e8m0fnu", None)


def test_config_keys_and_skipped_modules(caplog):
    with pytest.raises(ValueError, match=r"Unknown mxfp8 quantization_config key\(s\): block_size"):
        Mxfp8Quantizer.from_config({"block_size": 64}, prequantized=False)
    with caplog.at_level(logging.WARNING, logger="engine.xpu"):
        Mxfp8Quantizer.from_config({"quant_method": "mxfp8", "activation_scheme": "dynamic"}, prequantized=True)
    assert "activation_scheme" in caplog.text and "Ignored" in caplog.text
    with pytest.raises(ValueError, match="modules_to_not_convert must be a list"):
        Mxfp8Quantizer.from_config({"modules_to_not_convert": "o_proj"}, prequantized=False)
    quantizer = Mxfp8Quantizer.from_config({"modules_to_not_convert": ["o_proj", "vision_tower"]}, prequantized=False)
    assert quantizer.get_linear_method("model.layers.0.self_attn.o_proj") is None
    assert quantizer.get_linear_method("model.vision_tower.blocks.1.fc1") is None
    assert isinstance(quantizer.get_linear_method("model.layers.0.self_attn.qkv_proj"), Mxfp8LinearMethod)
    # names are matched as whole module names, not substrings
    assert isinstance(quantizer.get_linear_method("model.layers.0.self_attn.o_proj_extra"), Mxfp8LinearMethod)


def prequantized_layer(sizes, bias=False, dtype=torch.bfloat16):
    layer = MergedLinear(64, list(sizes), bias, dtype)
    layer.set_method(Mxfp8Quantizer.from_config({}, prequantized=True).get_linear_method("model.layers.0.mlp.up_proj"))
    return layer


def test_fused_weights_quantize_as_their_shards():
    """Scales run along rows: the fused layer quantized while loading holds exactly the
    bytes each shard's exported checkpoint tensors hold."""
    gen = torch.Generator().manual_seed(1)
    shards = [torch.randn(rows, 64, generator=gen) for rows in (32, 16, 16)]
    layer = MergedLinear(64, [32, 16, 16], False, torch.float32)
    layer.set_method(Mxfp8Quantizer.from_config({}, prequantized=False).get_linear_method("model.layers.0.qkv_proj"))
    for index, weight in enumerate(shards):
        layer.load_checkpoint_tensor("weight", index, weight)
    layer.method.process_weights_after_loading(layer)
    exported = [Mxfp8Quantizer.from_config({}, prequantized=False).export_weight(w, None) for w in shards]
    assert sorted(exported[0]) == ["weight", "weight_scale"]
    assert torch.equal(layer.weight.view(torch.uint8), torch.cat([e["weight"] for e in exported]).view(torch.uint8))
    assert torch.equal(layer.weight_scale, torch.cat([e["weight_scale"] for e in exported]))
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.shape == (64, 2)


@pytest.mark.skipif(E8M0 is None, reason="this torch has no float8_e8m0fnu")
def test_e8m0_scales_load_like_uint8_ones():
    gen = torch.Generator().manual_seed(2)
    elements, scales = mxfp8_quantize(torch.randn(48, 64, generator=gen))
    x = torch.randn(3, 64, generator=gen).bfloat16()
    outputs = []
    for scale_tensor in (scales, scales.view(E8M0)):
        layer = prequantized_layer([48])
        layer.load_checkpoint_tensor("weight", 0, elements)
        layer.load_checkpoint_tensor("weight_scale", 0, scale_tensor)
        layer.method.process_weights_after_loading(layer)
        assert layer.weight_scale.dtype == torch.uint8
        outputs.append(layer(x))
    assert torch.equal(outputs[0], outputs[1])
    torch.testing.assert_close(outputs[0], x @ mxfp8_dequantize(elements, scales, torch.bfloat16).T)


def test_prequantized_layers_refuse_unquantized_and_misshapen_tensors():
    layer = prequantized_layer([32, 16])
    with pytest.raises(ValueError, match="Shard 1's weight is torch.bfloat16, not float8_e4m3fn"):
        layer.load_checkpoint_tensor("weight", 1, torch.zeros(16, 64, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="uint8 or float8_e8m0fnu"):
        layer.load_checkpoint_tensor("weight_scale", 0, torch.zeros(32, 2))
    with pytest.raises(ValueError, match=r"expects shape \(32, 2\)"):
        layer.load_checkpoint_tensor("weight_scale", 0, torch.zeros(32, 4, dtype=torch.uint8))
    with pytest.raises(KeyError, match="weight_scale"):
        layer.load_checkpoint_tensor("weight_scale_inv", 0, torch.zeros(32, 2))


# a tiny Llama served by the engine

PLUGINS = ["cpu", "llama", "xpu"]


@pytest.fixture(scope="module")
def llama_checkpoints(tmp_path_factory):
    """(unquantized checkpoint dir, prequantized MXFP8 checkpoint dir, transformers model
    of the unquantized one)."""
    from safetensors.torch import load_file, save_file

    from engine.testing.checkpoints import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("mxfp8-llama")
    hf_model = make_tiny_checkpoint("LlamaForCausalLM", root / "base", initializer_range=0.1)
    shutil.copytree(root / "base", root / "mxfp8")
    quantizer = Mxfp8Quantizer.from_config({}, prequantized=False)
    tensors = {}
    for name, tensor in load_file(root / "base" / "model.safetensors").items():
        if name.endswith("_proj.weight"):  # every linear layer but the head
            for suffix, value in quantizer.export_weight(tensor, None).items():
                tensors[name.removesuffix("weight") + suffix] = value
        else:
            tensors[name] = tensor
    save_file(tensors, root / "mxfp8" / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((root / "mxfp8" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp8"}
    (root / "mxfp8" / "config.json").write_text(json.dumps(config))
    return root / "base", root / "mxfp8", hf_model


def make_llm(path, **kwargs):
    from engine import LLM

    return LLM(str(path), plugins=PLUGINS, dtype="float32", progress=False, kv_cache_memory=0.05, **kwargs)


def prompts(vocab_size):
    rng = random.Random(0)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in (3, 9, 17)]


def test_engine_logits_match_transformers_with_dequantized_weights(llama_checkpoints):
    base, prequantized, hf_model = llama_checkpoints
    reference = type(hf_model)(hf_model.config).eval()
    reference.load_state_dict(hf_model.state_dict())
    for name, module in reference.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            module.weight.data = mxfp8_dequantize(*mxfp8_quantize(module.weight.data))
    on_the_fly = make_llm(base, quantization="mxfp8")
    layer = on_the_fly.engine.model.model.layers[0].self_attn.qkv_proj
    assert layer.weight.dtype == torch.float8_e4m3fn and on_the_fly.engine.model.lm_head.weight.dtype == torch.float32
    batch = prompts(hf_model.config.vocab_size)
    for prompt, logits in zip(batch, on_the_fly.prompt_logits(batch)):
        with torch.no_grad():
            expected = reference(torch.tensor([prompt])).logits[0]
            unquantized = hf_model(torch.tensor([prompt])).logits[0]
        scale = expected.abs().max().item()
        assert (logits - expected).abs().max().item() <= 1e-4 * scale
        assert (logits - unquantized).abs().max().item() > 1e-3 * scale  # the weights were quantized
    # the prequantized checkpoint holds the same bytes: the same logits, bit for bit
    loaded = make_llm(prequantized)
    assert torch.equal(
        loaded.engine.model.model.layers[1].mlp.gate_up_proj.weight_scale,
        on_the_fly.engine.model.model.layers[1].mlp.gate_up_proj.weight_scale,
    )
    for a, b in zip(on_the_fly.prompt_logits(batch), loaded.prompt_logits(batch)):
        assert torch.equal(a, b)
