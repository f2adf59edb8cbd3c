"""engine-compressed-tensors against the pack-quantized format written out plainly here: words
unpacked with numpy bit arithmetic (element 0 in the low bits, values offset by 2**(bits-1)),
zero points packed along the outputs, W = scale * (q - zero); and tiny Llama checkpoints in the
format against transformers on the weights they stand for."""

from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pytest
import torch
from pack_quantized_reference import config, dequantize_reference, unpack_reference
from safetensors.torch import load_file, save_file

from engine import LLM
from engine.interfaces.group_quant import GroupQuantWeight
from engine.testing.checkpoints import make_tiny_checkpoint
from engine_compressed_tensors.packing import pack, unpack
from engine_compressed_tensors.quantizer import PackQuantizedQuantizer, Settings, to_group_quant

PLUGINS = ["cpu", "llama", "compressed_tensors"]
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# largest |engine − transformers| over the float32 logits, relative to the largest |logit|: the
# same dense weights, summed in another order
TOLERANCE = 1e-4


def test_hand_packed_words():
    """The library's own example: 8-bit values 1 and 2 are stored as 129 and 130, in the low bytes
    of one word (33409); 4-bit -8..7 fill a word from the low nibble up."""
    assert pack(torch.tensor([[129, 130]]), 8).tolist() == [[33409]]
    assert unpack(torch.tensor([[33409]], dtype=torch.int32), 8, 2).tolist() == [[129, 130]]
    nibbles = torch.arange(16).reshape(2, 8)  # stored values 0..15: q = -8..7
    words = pack(nibbles, 4)
    assert words.tolist() == [[0x76543210], [int(np.int32(np.uint32(0xFEDCBA98)))]]


@pytest.mark.parametrize("bits", [4, 8])
def test_unpacking_matches_the_bit_arithmetic(bits):
    gen = torch.Generator().manual_seed(bits)
    values = torch.randint(0, 1 << bits, (6, 40), generator=gen)  # 40: the last word of 4-bit padded
    words = pack(values, bits)
    assert words.dtype == torch.int32 and words.shape == (6, -(-40 // (32 // bits)))
    assert (unpack_reference(words.numpy(), bits, 40) == values.numpy()).all()
    assert torch.equal(unpack(words, bits, 40), values.to(torch.int32))
    along_outputs = pack(values, bits, dim=0)  # zero points: packed along the outputs
    assert along_outputs.shape == (-(-6 // (32 // bits)), 40)
    assert (unpack_reference(along_outputs.numpy(), bits, 6, axis=0) == values.numpy()).all()
    assert torch.equal(unpack(along_outputs, bits, 6, dim=0), values.to(torch.int32))


@pytest.mark.parametrize(
    "settings",
    [
        config(4, "group", True, 32),
        config(8, "channel", True),
        config(4, "group", False, 16),
        config(8, "group", False, 32),
    ],
    ids=["w4-g32", "w8-channel", "w4-g16-zero-points", "w8-g32-zero-points"],
)
def test_group_quant_weight_is_the_formula(settings):
    """Exported tensors, read back into the engine's layout, dequantize to the format's formula,
    and round-to-nearest lands within half a step of the weight."""
    quantizer = PackQuantizedQuantizer.from_config(settings, prequantized=False)
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(24, 64, generator=gen, dtype=torch.float32)
    tensors = quantizer.export_weight(weight, None)
    weights = settings["config_groups"]["group_0"]["weights"]
    bits, symmetric = weights["num_bits"], weights["symmetric"]
    assert ("weight_zero_point" in tensors) != symmetric
    assert tensors["weight_packed"].shape == (24, 64 * bits // 32) and tensors["weight_shape"].tolist() == [24, 64]
    expected = dequantize_reference(tensors, bits)
    layout = to_group_quant(tensors, Settings.parse(settings, prequantized=True), 24, 64)
    assert isinstance(layout, GroupQuantWeight)
    # float32 scale * u - scale * (z + offset): a few float32 roundings of values of up to 2**bits steps
    np.testing.assert_allclose(layout.dequantize().numpy(), expected, rtol=0, atol=np.abs(expected).max() * 2**-20)
    group = weights.get("group_size", 64)
    step = np.repeat(tensors["weight_scale"].float().numpy(), group, axis=1)
    assert (np.abs(expected - weight.numpy()) <= step / 2 + 1e-6).all()


def test_zero_points_stored_unpacked_by_earlier_versions():
    """Signed zero points [N, G] (not packed) give the same weight as packed ones."""
    settings = config(4, "group", False, 32)
    tensors = PackQuantizedQuantizer.from_config(settings, prequantized=False).export_weight(
        torch.randn(8, 64, generator=torch.Generator().manual_seed(1)), None
    )
    signed = unpack(tensors["weight_zero_point"], 4, 8, dim=0) - 8
    parsed = Settings.parse(settings, prequantized=True)
    packed = to_group_quant(tensors, parsed, 8, 64)
    unpacked = to_group_quant({**tensors, "weight_zero_point": signed.to(torch.int8)}, parsed, 8, 64)
    assert torch.equal(packed.dequantize(), unpacked.dequantize())


# checkpoints

VARIANTS = {
    "w4-g32-symmetric": (config(4, "group", True, 32), torch.bfloat16),
    "w8-channel-symmetric": (config(8, "channel", True), torch.float16),
    "w4-g32-zero-points": (config(4, "group", False, 32), torch.float32),
}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("ct") / "base"
    make_tiny_checkpoint("LlamaForCausalLM", path, initializer_range=0.1)
    return path


def write_checkpoint(base, path, tensors: dict, quantization_config: dict | None) -> None:
    path.mkdir()
    for name in ("config.json", "generation_config.json"):
        shutil.copy(base / name, path / name)
    config_json = json.loads((base / "config.json").read_text())
    if quantization_config is not None:
        config_json["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config_json))
    save_file({name: t.contiguous() for name, t in tensors.items()}, path / "model.safetensors", {"format": "pt"})


def quantize_checkpoint(base, root, variant: str):
    """The pack-quantized checkpoint of ``variant`` and one of the dense weights it stands for."""
    settings, scale_dtype = VARIANTS[variant]
    quantizer = PackQuantizedQuantizer.from_config(settings, prequantized=False)
    bits = settings["config_groups"]["group_0"]["weights"]["num_bits"]
    quantized, dense = {}, {}
    for name, tensor in load_file(base / "model.safetensors").items():
        module = name.removesuffix(".weight")
        if module.split(".")[-1] not in LINEAR:
            quantized[name] = dense[name] = tensor
            continue
        tensors = quantizer.export_weight(tensor.to(scale_dtype), None)  # scales in the model's dtype
        quantized.update({f"{module}.{key}": value for key, value in tensors.items()})
        dense[name] = torch.from_numpy(dequantize_reference(tensors, bits)).float()
    write_checkpoint(base, root / variant, quantized, settings)
    write_checkpoint(base, root / f"{variant}-dense", dense, None)
    return root / variant, root / f"{variant}-dense"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers_on_the_dequantized_weights(base, tmp_path, variant):
    import transformers

    quantized, dense = quantize_checkpoint(base, tmp_path, variant)
    llm = LLM(str(quantized), plugins=PLUGINS, dtype="float32", progress=False, kv_cache_memory=0.05)
    assert isinstance(llm.engine.setup.quantizer, PackQuantizedQuantizer) and llm.engine.setup.dequantizer is None
    qkv = llm.engine.model.model.layers[0].self_attn.qkv_proj
    [(_, _, held)] = qkv.group_quant
    assert not hasattr(qkv, "weight") and isinstance(held, GroupQuantWeight)
    assert held.qweight is qkv.qweight
    hf_model = transformers.LlamaForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in (3, 11, 25)]
    for prompt, logits in zip(prompts, llm.prompt_logits(prompts)):
        with torch.no_grad():
            reference = hf_model(torch.tensor([prompt])).logits[0]
        error = (logits.float() - reference).abs().max().item() / reference.abs().max().item()
        assert error <= TOLERANCE, f"{variant}: relative logit difference {error:.2e}"


def test_quantizing_while_loading_holds_the_checkpoint_weights(base, tmp_path):
    """--quantization compressed-tensors/pack-quantized with the checkpoint's settings holds the
    very weights of the prequantized checkpoint (float32 scales on both sides)."""
    quantized, _ = quantize_checkpoint(base, tmp_path, "w4-g32-zero-points")
    settings = VARIANTS["w4-g32-zero-points"][0]
    on_the_fly = LLM(
        str(base),
        plugins=PLUGINS,
        dtype="float32",
        progress=False,
        kv_cache_memory=0.05,
        quantization="compressed-tensors/pack-quantized",
        quantization_config=settings,
    )
    prequantized = LLM(str(quantized), plugins=PLUGINS, dtype="float32", progress=False, kv_cache_memory=0.05)

    def held(llm) -> dict:
        params = llm.engine.model.named_parameters()
        return {name: p for name, p in params if name.split(".")[-1] in ("qweight", "scales", "offsets")}

    expected, got = held(prequantized), held(on_the_fly)
    assert len(expected) == 2 * 4 * 3 and sorted(got) == sorted(expected)  # 2 layers of qkv, o, gate_up, down
    for name, param in expected.items():
        assert torch.equal(param, got[name]), name


def test_shapes_that_do_not_match_the_config_name_both(base, tmp_path):
    quantized, _ = quantize_checkpoint(base, tmp_path, "w4-g32-symmetric")
    wrong = tmp_path / "wrong"
    shutil.copytree(quantized, wrong)
    config_json = json.loads((wrong / "config.json").read_text())
    config_json["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 16
    (wrong / "config.json").write_text(json.dumps(config_json))
    with pytest.raises(ValueError, match=r"weight_scale is \(\d+, 2\) torch.bfloat16; .* expects \(\d+, 4\)"):
        LLM(str(wrong), plugins=PLUGINS, dtype="float32", progress=False, kv_cache_memory=0.05)


# settings

W8A8 = {"num_bits": 8, "type": "int", "strategy": "token", "symmetric": True, "dynamic": True}


@pytest.mark.parametrize(
    "change,message",
    [
        ({"input_activations": W8A8}, r"quantizes the input activations too .* weight-only schemes \(W4A16, W8A16\)"),
        ({"format": "int-quantized"}, r"format int-quantized; it runs pack-quantized only"),
        ({"targets": ["re:.*mlp.*"]}, r"targets \['re:\.\*mlp\.\*'\]"),
    ],
)
def test_unsupported_groups_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        PackQuantizedQuantizer.from_config(config(4, "group", True, 128, **change), prequantized=True)


@pytest.mark.parametrize(
    "weights,message",
    [
        ({"num_bits": 2}, r"2-bit 'int'; engine-compressed-tensors computes 4- or 8-bit int weights"),
        ({"type": "float"}, r"4-bit 'float'"),
        ({"strategy": "tensor"}, r"strategy 'tensor'"),
        ({"group_size": 0}, r"group_size .* got 0"),
        ({"actorder": "group"}, r"actorder 'group'"),
        ({"dynamic": True}, r"dynamic"),
    ],
)
def test_unsupported_weights_are_refused(weights, message):
    settings = config(4, "group", True, 128)
    settings["config_groups"]["group_0"]["weights"].update(weights)
    with pytest.raises(ValueError, match=message):
        PackQuantizedQuantizer.from_config(settings, prequantized=True)


def test_groups_of_different_schemes_are_refused():
    settings = config(4, "group", True, 128)
    settings["config_groups"]["group_1"] = config(8, "channel", True)["config_groups"]["group_0"]
    with pytest.raises(ValueError, match="quantize weights differently"):
        PackQuantizedQuantizer.from_config(settings, prequantized=True)


def test_ignore_names_and_regexes():
    settings = config(4, "group", True, 128)
    settings["ignore"] = [
        "lm_head",
        "re:.*mlp\\.down_proj$",
        "model.layers.1.self_attn.q_proj",
        "model.layers.1.self_attn.k_proj",
        "model.layers.1.self_attn.v_proj",
    ]
    quantizer = PackQuantizedQuantizer.from_config(settings, prequantized=True)
    assert quantizer.get_linear_method("model.layers.0.mlp.down_proj") is None
    assert quantizer.get_linear_method("model.layers.1.self_attn.qkv_proj") is None  # all three of its parts
    assert quantizer.get_linear_method("model.layers.0.self_attn.qkv_proj") is not None
    assert quantizer.get_linear_method("model.layers.0.mlp.gate_up_proj") is not None
    settings["ignore"] = ["model.layers.0.mlp.gate_proj"]
    with pytest.raises(ValueError, match="ignore all of them or none"):
        PackQuantizedQuantizer.from_config(settings, prequantized=True).get_linear_method(
            "model.layers.0.mlp.gate_up_proj"
        )
