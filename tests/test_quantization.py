"""The quantizer contract in the engine: choosing the method, routing prequantized
checkpoint tensors to their layers, and the errors on the way. The third party's
quantizer here is the example plugin's ``example_int8``."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM
from engine.layers.linear import MergedLinear, quantize_model, route_linear_tensor
from engine.selection import SelectionError
from engine_example_plugins.int8_quantizer import Int8Quantizer

PLUGINS = ["cpu", "llama", "example"]
PROMPTS = [[5, 17, 42, 7, 99], [3, 4, 5]]


class RocmOnly(Int8Quantizer):
    name = "rocm_only"
    supported_platforms = frozenset({"rocm"})


class Float32Only(Int8Quantizer):
    name = "float32_only"
    activation_dtypes = frozenset({"float32"})


class QuantizesEverything(Int8Quantizer):
    name = "quantizes_everything"

    def get_linear_method(self, layer_name):
        from engine_example_plugins.int8_quantizer import Int8LinearMethod

        return Int8LinearMethod(self.prequantized)


def make_llm(path, **kwargs) -> LLM:
    options = {"plugins": PLUGINS, "dtype": "float32", "kv_cache_memory": 0.01, "progress": False, **kwargs}
    return LLM(str(path), **options)


def set_quantization_config(path, config) -> None:
    data = json.loads((path / "config.json").read_text())
    data["quantization_config"] = config
    (path / "config.json").write_text(json.dumps(data))


def prequantize(source, target) -> None:
    """Write ``source``'s checkpoint as example_int8 would store it: every linear module's
    weight as int8 + weight_scale, lm_head and everything else as they are."""
    shutil.copytree(source, target)
    quantizer = Int8Quantizer.from_config({}, prequantized=False)
    tensors = {}
    for name, tensor in load_file(str(source / "model.safetensors")).items():
        if name.endswith("proj.weight"):
            module = name.removesuffix(".weight")
            tensors.update({f"{module}.{k}": v for k, v in quantizer.export_weight(tensor, None).items()})
        else:
            tensors[name] = tensor
    save_file(tensors, str(target / "model.safetensors"))
    set_quantization_config(target, {"quant_method": "example_int8"})


def test_route_linear_tensor_finds_the_layer_shard_and_tensor_name():
    layers = {
        name: MergedLinear(4, [4], False, torch.float32)
        for name in ("model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj", "lm_head")
    }
    stacked = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}
    route = lambda name: route_linear_tensor(layers, name, stacked)  # noqa: E731
    assert route("model.layers.0.self_attn.k_proj.weight") == ("model.layers.0.self_attn.qkv_proj", 1, "weight")
    assert route("model.layers.0.self_attn.v_proj.weight.quant_state.bitsandbytes__nf4") == (
        "model.layers.0.self_attn.qkv_proj",
        2,
        "weight.quant_state.bitsandbytes__nf4",
    )
    assert route("model.layers.0.self_attn.o_proj.SCB") == ("model.layers.0.self_attn.o_proj", 0, "SCB")
    assert route("lm_head.weight") == ("lm_head", 0, "weight")
    assert route("model.layers.0.input_layernorm.weight") is None
    assert route("model.layers.1.self_attn.q_proj.weight") is None


def test_prequantized_checkpoint_gives_the_logits_of_quantizing_while_loading(tiny_checkpoint, tmp_path):
    path, _ = tiny_checkpoint("LlamaForCausalLM", attention_bias=True)
    prequantize(path, tmp_path / "int8")
    loaded = make_llm(tmp_path / "int8")
    on_the_fly = make_llm(path, quantization="example_int8")
    unquantized = make_llm(path)
    qkv = loaded.engine.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.int8 and loaded.engine.model.lm_head.weight.dtype == torch.float32
    for a, b, c in zip(
        loaded.prompt_logits(PROMPTS), on_the_fly.prompt_logits(PROMPTS), unquantized.prompt_logits(PROMPTS)
    ):
        assert torch.equal(a, b)
        assert not torch.equal(a, c) and (a - c).abs().max() < 0.05 * c.abs().max()


def test_missing_quantizer_plugin_names_the_package_to_install(tiny_checkpoint):
    path, _ = tiny_checkpoint("LlamaForCausalLM")
    set_quantization_config(path, {"quant_method": "bitsandbytes", "load_in_4bit": True})
    with pytest.raises(SelectionError, match=r"install engine-bitsandbytes \(pip install engine-bitsandbytes\)"):
        make_llm(path, plugins=["cpu", "llama"])
    set_quantization_config(path, {"quant_method": "awq"})
    with pytest.raises(SelectionError, match=r"install engine-awq \(pip install engine-awq\)"):
        make_llm(path)
    set_quantization_config(path, {"quant_method": "aqlm"})
    with pytest.raises(SelectionError, match="install a plugin that registers the quantization method 'aqlm'"):
        make_llm(path)


def test_missing_prequantized_tensor_is_named(tiny_checkpoint, tmp_path):
    path, _ = tiny_checkpoint("LlamaForCausalLM")
    prequantize(path, tmp_path / "int8")
    tensors = load_file(str(tmp_path / "int8" / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.weight_scale"]
    save_file(tensors, str(tmp_path / "int8" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.qkv_proj\.weight_scale\[1\]"):
        make_llm(tmp_path / "int8")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"quantization": "example_int8"}, None),
        ({"quantization": "bitsandbytes"}, "already quantized with 'example_int8'"),
        ({"quantization_config": {"x": 1}}, "applies to on-the-fly quantization"),
    ],
)
def test_options_against_a_prequantized_checkpoint(tiny_checkpoint, tmp_path, options, message):
    path, _ = tiny_checkpoint("LlamaForCausalLM")
    prequantize(path, tmp_path / "int8")
    if message is None:
        assert make_llm(tmp_path / "int8", **options).engine.quantizer.prequantized
    else:
        with pytest.raises(SelectionError, match=message):
            make_llm(tmp_path / "int8", **options)


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"quantization_config": {"bits": 4}}, SelectionError, "without --quantization"),
        ({"quantization": f"{__name__}:RocmOnly"}, SelectionError, "does not run on platform 'cpu'; it supports rocm"),
        (
            {"quantization": f"{__name__}:Float32Only", "dtype": "bfloat16"},
            SelectionError,
            "computes in float32, not bfloat16",
        ),
        (
            {"quantization": "example_int8", "quantization_config": {"bits": 4}},
            ValueError,
            "takes no settings; got bits",
        ),
        (
            {"quantization": f"{__name__}:QuantizesEverything"},
            ValueError,
            "lm_head, whose weight is tied to model.embed_tokens",
        ),
    ],
)
def test_bad_quantization_options_are_refused_clearly(tiny_checkpoint, options, error, message):
    path, _ = tiny_checkpoint("Qwen2ForCausalLM")  # tied embeddings
    with pytest.raises(error, match=message):
        make_llm(path, **options)


def test_quantize_model_reports_what_it_quantized_and_declined(tiny_checkpoint):
    llm = make_llm(tiny_checkpoint("LlamaForCausalLM")[0])
    quantized, declined = quantize_model(llm.engine.model, Int8Quantizer.from_config({}, prequantized=False))
    assert declined == ["lm_head"]
    assert sorted(quantized) == sorted(
        f"model.layers.{i}.{name}"
        for i in range(2)
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    )
