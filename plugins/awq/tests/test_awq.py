"""engine-awq against the AWQ GEMM format as written in awq_reference.py: a hand-packed word and
module, random modules loaded as a prequantized checkpoint and multiplied against x Wᵀ with W
dequantized by the reference, what round-to-nearest export writes, a tiny Llama quantized into
an AWQ checkpoint against the same model with the dequantized weights, and the configurations
that fail at start."""

from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pytest
import torch
from awq_reference import dequantize, pack_words, random_module, unpack_words
from safetensors.torch import load_file, save_file

from engine import LLM
from engine.interfaces.group_quant import GroupQuantWeight
from engine.interfaces.ops import LayerOps
from engine.layers.linear import MergedLinear
from engine.testing.checkpoints import make_tiny_checkpoint
from engine_awq.packing import pack, unpack
from engine_awq.quantizer import AwqQuantizer

NAME = "model.layers.0.self_attn.qkv_proj"
PLUGINS = ["cpu", "llama", "awq"]
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# as AutoAWQ writes it into config.json
AWQ_CONFIG = {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"}
# largest |awq − dequantized| over the logits, relative to the largest |logit|: the AWQ layers
# compute the float32 weight, the dense model the weight rounded to its dtype. Measured 1.9e-2 in
# bfloat16 (the weights' bfloat16 rounding carried through the bfloat16 layers) and 0 in float32,
# where only the order of the float32 sums may differ
TOLERANCE = {"float32": 1e-5, "bfloat16": 3e-2}


def awq_layer(config: dict, inputs: int, shards: list[dict], dtype: torch.dtype, bias=None) -> MergedLinear:
    """A prequantized layer of one output shard per module in ``shards`` (numpy tensors)."""
    quantizer = AwqQuantizer.from_config({"quant_method": "awq", **config}, prequantized=True)
    sizes = [module["scales"].shape[1] for module in shards]
    layer = MergedLinear(inputs, sizes, bias is not None, dtype)
    layer.set_method(quantizer.get_linear_method(NAME))
    for index, module in enumerate(shards):
        for name, array in module.items():
            layer.load_checkpoint_tensor(name, index, torch.from_numpy(np.ascontiguousarray(array)))
        if bias is not None:
            layer.load_checkpoint_tensor("bias", index, bias[index])
    assert not layer.missing_tensors()
    layer.method.process_weights_after_loading(layer)
    return layer


# format


def test_hand_packed_word():
    """Outputs 0..7 holding the values 0..7: the word holds, from the lowest nibble up, outputs
    0, 2, 4, 6, 1, 3, 5, 7, so 0x75316420 (a plain order would be 0x76543210)."""
    values = np.arange(8).reshape(1, 8)
    word = np.array([[0x75316420]], dtype=np.uint32).view(np.int32)
    assert np.array_equal(pack_words(values), word) and np.array_equal(unpack_words(word), values)
    assert torch.equal(pack(torch.from_numpy(values)), torch.from_numpy(word))
    assert torch.equal(unpack(torch.from_numpy(word)), torch.arange(8, dtype=torch.int32).view(1, 8))


def test_hand_packed_module():
    """4 inputs, 8 outputs, groups of 2: q[k, n] = k + n; group 0 has zero 8 and scale 0.5,
    group 1 zero n and scale (n + 1) / 4, so W[n, k] = 0.5 (k + n - 8) for k < 2 and
    (n + 1) / 4 * k for k >= 2."""
    qweight = np.array([[0x75316420], [0x86427531], [0x97538642], [0xA8649753]], dtype=np.uint32).view(np.int32)
    qzeros = np.array([[0x88888888], [0x75316420]], dtype=np.uint32).view(np.int32)
    scales = np.array([[0.5] * 8, [(n + 1) / 4 for n in range(8)]], dtype=np.float16)
    module = {"qweight": qweight, "qzeros": qzeros, "scales": scales}
    expected = np.array([[0.5 * (k + n - 8) if k < 2 else (n + 1) / 4 * k for k in range(4)] for n in range(8)])
    assert expected[0, 0] == -4.0 and expected[7, 3] == 6.0
    assert np.array_equal(dequantize(module, group_size=2), expected)
    layer = awq_layer({"group_size": 2}, 4, [module], torch.float32)
    with torch.no_grad():
        w_transposed = layer(torch.eye(4))  # x = I: row k of the output is W[:, k]
    assert torch.equal(w_transposed, torch.from_numpy(expected.T).float())


class RecordingOps(LayerOps):
    """The reference layer ops, noting each group-quantized weight they are given."""

    def __init__(self) -> None:
        self.weights: list[GroupQuantWeight] = []

    def group_quant_linear(self, x, weight, bias=None):
        self.weights.append(weight)
        return super().group_quant_linear(x, weight, bias)


@pytest.mark.parametrize("group_size", [32, 128, -1])
def test_random_modules_match_the_dequantized_matmul(group_size):
    """A fused layer of two modules of 256 inputs with a bias, held as one GroupQuantWeight (its
    parameters, the AWQ tensors gone) that ``layer.ops`` computes: the weight dequantized is the
    reference's W exactly, and y = x Wᵀ + b to float32 rounding in float32 and to the rounding
    of the output in bfloat16 and float16 (half an ulp: 2**-9, 2**-12)."""
    rng = np.random.default_rng(group_size + 1000)
    inputs = 256
    shards = [random_module(rng, inputs, rows, group_size) for rows in (64, 32)]
    weight = np.concatenate([dequantize(m, group_size) for m in shards])  # [96, 256]
    bias = [torch.randn(m["scales"].shape[1], generator=torch.Generator().manual_seed(i)) for i, m in enumerate(shards)]
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 4e-3), (torch.float16, 5e-4)):
        layer = awq_layer({"group_size": group_size}, inputs, shards, dtype, [b.to(dtype) for b in bias])
        assert {name for name, _ in layer.named_parameters()} == {"qweight", "scales", "offsets", "bias"}
        [(_, _, held)] = layer.group_quant
        assert np.array_equal(held.dequantize().double().numpy(), weight)
        layer.ops = RecordingOps()
        for tokens in (1, 7, 40):
            x = torch.randn(tokens, inputs, generator=torch.Generator().manual_seed(tokens)).to(dtype)
            expected = x.double() @ torch.from_numpy(weight).T + torch.cat(bias).to(dtype).double()
            with torch.no_grad():
                y = layer(x)
            assert y.dtype == dtype and y.shape == (tokens, 96)
            error = ((y.double() - expected).norm() / expected.norm()).item()
            assert error <= tolerance, f"{dtype}, {tokens} tokens: relative error {error:.2e}"
        assert layer.ops.weights == [held] * 3, "the layer did not compute through layer.ops"


@pytest.mark.parametrize("zero_point", [True, False])
def test_round_to_nearest_export_decodes_within_half_a_step(zero_point):
    """What the plugin writes (export_weight, also what quantizing while loading holds) is valid
    AWQ: decoded by the reference, every weight lies within half a quantization step of the
    original (a step is its group's scale) plus the rounding of the scale to float16 (2**-11 of
    the weight); symmetric: every zero is 8."""
    quantizer = AwqQuantizer.from_config({"group_size": 32, "zero_point": zero_point}, prequantized=False)
    weight = torch.randn(48, 128, generator=torch.Generator().manual_seed(3))
    tensors = {name: t.numpy() for name, t in quantizer.export_weight(weight, None).items()}
    assert tensors["qweight"].shape == (128, 6) and tensors["qweight"].dtype == np.int32
    assert tensors["qzeros"].shape == (4, 6) and tensors["scales"].shape == (4, 48)
    assert tensors["scales"].dtype == np.float16
    if not zero_point:
        assert (unpack_words(tensors["qzeros"]) == 8).all()
    step = np.repeat(tensors["scales"].astype(np.float64), 32, axis=0).T  # [48, 128]
    original = weight.double().numpy()
    error = np.abs(dequantize(tensors, 32) - original)
    assert (error <= step / 2 + np.abs(original) * 2**-11).all(), f"largest error {(error / step).max():.4f} steps"


# checkpoints


def write_checkpoint(base, path, tensors: dict, quantization_config: dict | None) -> None:
    path.mkdir()
    for name in ("config.json", "generation_config.json"):
        shutil.copy(base / name, path / name)
    if quantization_config is not None:
        config = json.loads((base / "config.json").read_text())
        config["quantization_config"] = quantization_config
        (path / "config.json").write_text(json.dumps(config))
    save_file({name: t.contiguous() for name, t in tensors.items()}, path / "model.safetensors", {"format": "pt"})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(a bf16 checkpoint, its AWQ checkpoint, the AWQ weights dequantized by the reference, unquantized)."""
    root = tmp_path_factory.mktemp("awq")
    make_tiny_checkpoint(
        "LlamaForCausalLM",
        root / "base",
        dtype="bfloat16",
        initializer_range=0.1,
        hidden_size=128,
        intermediate_size=256,
    )
    state = load_file(root / "base" / "model.safetensors")
    quantizer = AwqQuantizer.from_config(AWQ_CONFIG, prequantized=False)
    quantized, dequantized = {}, {}
    for name, tensor in state.items():
        module = name.removesuffix(".weight")
        if module.split(".")[-1] not in LINEAR:
            quantized[name] = dequantized[name] = tensor
            continue
        awq = quantizer.export_weight(tensor, None)
        quantized.update({f"{module}.{key}": value for key, value in awq.items()})
        numpy_tensors = {key: value.numpy() for key, value in awq.items()}
        dequantized[name] = torch.from_numpy(dequantize(numpy_tensors, AWQ_CONFIG["group_size"])).float()
    write_checkpoint(root / "base", root / "awq", quantized, AWQ_CONFIG)
    write_checkpoint(root / "base", root / "dequantized", dequantized, None)
    return root / "base", root / "awq", root / "dequantized"


def make_llm(path, dtype: str, **kwargs) -> LLM:
    return LLM(str(path), plugins=PLUGINS, dtype=dtype, progress=False, kv_cache_memory=0.05, **kwargs)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logits_match_the_dequantized_model(checkpoints, dtype):
    _, awq, dequantized = checkpoints
    llm = make_llm(awq, dtype)
    qkv = llm.engine.model.model.layers[0].self_attn.qkv_proj
    assert not hasattr(qkv, "weight") and not hasattr(qkv, "qzeros"), "the layer keeps more than its weight"
    [(_, _, held)] = qkv.group_quant
    assert isinstance(held, GroupQuantWeight) and held.qweight is qkv.qweight
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in (3, 11, 25)]
    for got, want in zip(llm.prompt_logits(prompts), make_llm(dequantized, dtype).prompt_logits(prompts)):
        error = (got.float() - want.float()).abs().max().item() / want.float().abs().max().item()
        assert error <= TOLERANCE[dtype], f"{dtype}: relative logit difference {error:.2e}"


def test_quantizing_while_loading_matches_the_prequantized_checkpoint(checkpoints):
    """--quantization awq on the bf16 checkpoint holds the very weights of the AWQ checkpoint."""
    base, awq, _ = checkpoints
    settings = {key: AWQ_CONFIG[key] for key in ("group_size", "zero_point")}
    on_the_fly = make_llm(base, "bfloat16", quantization="awq", quantization_config=settings)
    prequantized = make_llm(awq, "bfloat16")

    def held(llm) -> dict:
        params = llm.engine.model.named_parameters()
        return {name: p for name, p in params if name.split(".")[-1] in ("qweight", "scales", "offsets")}

    expected, got = held(prequantized), held(on_the_fly)
    assert len(expected) == 2 * 4 * 3 and sorted(got) == sorted(expected)  # 2 layers of qkv, o, gate_up, down
    for name, param in expected.items():
        assert torch.equal(param, got[name]), name


def set_quantization_config(src, dst, **change) -> None:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"].update(change)
    (dst / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "change,message",
    [
        (
            {"version": "gemv"},
            r"AWQ version 'gemv' \(the checkpoint's quantization_config\) is not supported: .*\[N, K / 8\]",
        ),
        ({"bits": 8}, r"AWQ with bits=8 .* engine-awq computes 4-bit AWQ weights"),
    ],
)
def test_unsupported_checkpoints_fail_at_start(checkpoints, tmp_path, change, message):
    _, awq, _ = checkpoints
    set_quantization_config(awq, tmp_path / "awq", **change)
    with pytest.raises(ValueError, match=message):
        make_llm(tmp_path / "awq", "bfloat16")


def test_group_size_that_does_not_match_the_tensors_names_their_shapes(checkpoints, tmp_path):
    """Groups of 64 whose config says 128: loading names the tensor, its shape and the one expected."""
    _, awq, _ = checkpoints
    set_quantization_config(awq, tmp_path / "awq", group_size=128)
    with pytest.raises(ValueError, match=r"AWQ qzeros is \(2, 16\) torch.int32; .* groups of 128 expects \(1, 16\)"):
        make_llm(tmp_path / "awq", "bfloat16")


# settings


@pytest.mark.parametrize(
    "change,message",
    [
        ({}, None),
        ({"version": "GEMM", "group_size": None, "bits": None, "q_group_size": 64, "w_bit": 4}, None),
        ({"version": "exllama"}, None),
        ({"version": "GEMV"}, r"AWQ version 'GEMV' .* packs qweight along the inputs"),
        ({"version": "gemv_fast"}, r"AWQ version 'gemv_fast' .* interleaves qweight"),
        ({"version": "marlin"}, r"AWQ version 'marlin' .* tiles qweight .* reads the GEMM layout"),
        ({"bits": 3}, r"bits=3 \(the checkpoint's quantization_config\) is not supported"),
        ({"w_bit": 8, "bits": None}, r"bits=8 .* 4-bit AWQ weights"),
        ({"backend": "llm-awq"}, r"AWQ backend 'llm-awq' .* llm-awq packs its tensors otherwise"),
        ({"group_size": 0}, r"group_size must be -1 or an integer of at least 2, got 0"),
        ({"zero_point": "yes"}, r"zero_point must be true or false, got 'yes'"),
        ({"modules_to_not_convert": "visual"}, r"modules_to_not_convert must be a list"),
    ],
)
def test_checkpoint_settings(change, message):
    config = {key: value for key, value in {**AWQ_CONFIG, **change}.items() if value is not None}
    if message is None:
        settings = AwqQuantizer.from_config(config, prequantized=True).settings
        assert (settings.group_size, settings.zero_point) == (64, True)
        return
    with pytest.raises(ValueError, match=message):
        AwqQuantizer.from_config(config, prequantized=True)


def test_quantizing_while_loading_refuses_unknown_keys():
    with pytest.raises(ValueError, match=r"Unknown AWQ --quantization-config key\(s\): q_group_size\. Known: bits"):
        AwqQuantizer.from_config({"q_group_size": 64}, prequantized=False)


def test_modules_to_not_convert_are_left_unquantized():
    """Layers the checkpoint left in full precision (matched by name within the module path, as
    AutoAWQ and vLLM match them) get no AWQ method; the head and router gates never do."""
    quantizer = AwqQuantizer.from_config({**AWQ_CONFIG, "modules_to_not_convert": ["mlp.down_proj"]}, prequantized=True)
    assert quantizer.get_linear_method("model.layers.3.mlp.down_proj") is None
    assert quantizer.get_linear_method("model.layers.3.mlp.gate_up_proj") is not None
    assert (
        quantizer.get_linear_method("lm_head") is None
        and quantizer.get_linear_method("model.layers.0.mlp.gate") is None
    )
