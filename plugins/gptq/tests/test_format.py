"""engine-gptq's layers against the GPTQ format as written in gptq_reference.py: a
hand-packed module, then random modules of every supported variant, loaded as a
prequantized checkpoint and multiplied, against x Wᵀ with W dequantized by the reference."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from gptq_reference import dequantize, random_module, unpack_words

from engine.interfaces.group_quant import GroupQuantWeight
from engine.interfaces.ops import LayerOps
from engine.layers.linear import MergedLinear
from engine_gptq.quantizer import GptqQuantizer

NAME = "model.layers.0.self_attn.qkv_proj"


def gptq_layer(config: dict, inputs: int, shards: list[dict], dtype: torch.dtype, bias=None) -> MergedLinear:
    """A prequantized layer of one output shard per module in ``shards`` (numpy tensors)."""
    quantizer = GptqQuantizer.from_config({"quant_method": "gptq", **config}, prequantized=True)
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


def test_hand_packed_module():
    """8 inputs, 8 outputs, 4 bits, groups of 4: q[k, n] = (k + n) % 16, so output n's word
    holds n, n+1, ..., n+7 from the lowest nibble up; group 0 is symmetric (zero 8, stored
    7), group 1 has zero n + 1 (stored n); scales 0.5 and (n + 1) / 4."""
    qweight = np.array(
        [[0x76543210, 0x87654321, 0x98765432, 0xA9876543, 0xBA987654, 0xCBA98765, 0xDCBA9876, 0xEDCBA987]],
        dtype=np.uint32,
    ).view(np.int32)
    qzeros = np.array([[0x77777777], [0x76543210]], dtype=np.uint32).view(np.int32)
    scales = np.array([[0.5] * 8, [(n + 1) / 4 for n in range(8)]], dtype=np.float16)
    g_idx = np.array([0, 0, 0, 0, 1, 1, 1, 1], dtype=np.int32)
    module = {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx}
    # by hand: W[n, k] = 0.5 * ((k + n) % 16 - 8) for k < 4, (n + 1) / 4 * ((k + n) % 16 - (n + 1)) for k >= 4
    expected = np.array(
        [
            [0.5 * ((k + n) % 16 - 8) if k < 4 else (n + 1) / 4 * ((k + n) % 16 - (n + 1)) for k in range(8)]
            for n in range(8)
        ]
    )
    assert expected[0, 0] == -4.0 and expected[1, 5] == 0.5 * 4 and expected[7, 4] == 2 * (11 - 8)
    assert np.array_equal(dequantize(module, bits=4), expected)
    layer = gptq_layer({"bits": 4, "group_size": 4, "sym": False}, 8, [module], torch.float32)
    with torch.no_grad():
        w_transposed = layer(torch.eye(8))  # x = I: row k of the output is W[:, k]
    assert torch.equal(w_transposed, torch.from_numpy(expected.T).float())


VARIANTS = list(itertools.product((4, 8), (32, 128, -1), (False, True), (True, False), ("gptq", "gptq_v2")))


@pytest.mark.parametrize(
    "bits,group_size,act_order,sym,fmt",
    VARIANTS,
    ids=[f"{b}bit-g{g}-{'actorder' if a else 'inorder'}-{'sym' if s else 'asym'}-{f}" for b, g, a, s, f in VARIANTS],
)
def test_random_modules_match_the_dequantized_matmul(bits, group_size, act_order, sym, fmt):
    """A fused layer of two modules (each with its own act-order permutation) of 256 inputs,
    with a bias: y = x Wᵀ + b for W dequantized by the reference (exact: the layer computes
    the float32 weight), to float32 rounding in float32 and to the rounding of the output in
    bfloat16 and float16 (half an ulp: 2**-9, 2**-12)."""
    rng = np.random.default_rng(bits * 1000 + group_size + 10 * act_order + 3 * sym + len(fmt))
    inputs = 256
    shards = [random_module(rng, inputs, rows, bits, group_size, sym, act_order, fmt) for rows in (64, 32)]
    weight = np.concatenate([dequantize(m, bits, fmt) for m in shards])  # [96, 256]
    bias = [torch.randn(m["scales"].shape[1], generator=torch.Generator().manual_seed(i)) for i, m in enumerate(shards)]
    config = {"bits": bits, "group_size": group_size, "sym": sym, "desc_act": act_order, "checkpoint_format": fmt}
    dtypes = ((torch.float32, 1e-5), (torch.bfloat16, 4e-3), (torch.float16, 5e-4))
    for dtype, tolerance in dtypes:
        layer = gptq_layer(config, inputs, shards, dtype, [b.to(dtype) for b in bias])
        for tokens in (1, 7, 40):
            x = torch.randn(tokens, inputs, generator=torch.Generator().manual_seed(tokens)).to(dtype)
            expected = x.double() @ torch.from_numpy(weight).T + torch.cat(bias).to(dtype).double()
            with torch.no_grad():
                y = layer(x)
            assert y.dtype == dtype and y.shape == (tokens, 96)
            error = ((y.double() - expected).norm() / expected.norm()).item()
            assert error <= tolerance, f"{dtype}, {tokens} tokens: relative error {error:.2e}"


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
def test_round_to_nearest_export_decodes_within_half_a_step(bits, sym, act_order):
    """What the plugin writes (export_weight, also what quantizing while loading holds) is
    valid GPTQ: decoded by the reference, every weight lies within half a quantization step
    of the original (a step is its group's scale), plus the rounding of the scale to float16
    (2**-11 of the weight); g_idx gives groups of group_size rows."""
    config = {"bits": bits, "group_size": 32, "sym": sym, "desc_act": act_order}
    quantizer = GptqQuantizer.from_config(config, prequantized=False)
    weight = torch.randn(48, 128, generator=torch.Generator().manual_seed(bits))
    tensors = {name: t.numpy() for name, t in quantizer.export_weight(weight, None).items()}
    assert tensors["qweight"].shape == (128 * bits // 32, 48) and tensors["qweight"].dtype == np.int32
    assert tensors["qzeros"].shape == (4, 48 * bits // 32) and tensors["scales"].dtype == np.float16
    assert np.array_equal(np.bincount(tensors["g_idx"]), [32] * 4)
    assert (tensors["g_idx"] != np.arange(128) // 32).any() == act_order
    if sym:
        assert (unpack_words(tensors["qzeros"], bits, axis=1) + 1 == 2 ** (bits - 1)).all()
    step = tensors["scales"].astype(np.float64)[tensors["g_idx"]].T  # [48, 128]
    original = weight.double().numpy()
    error = np.abs(dequantize(tensors, bits) - original)
    assert (error <= step / 2 + np.abs(original) * 2**-11).all(), f"largest error {(error / step).max():.4f} steps"


class RecordingOps(LayerOps):
    """The reference layer ops, noting each group-quantized weight they are given."""

    def __init__(self) -> None:
        self.weights: list[GroupQuantWeight] = []

    def group_quant_linear(self, x, weight, bias=None):
        self.weights.append(weight)
        return super().group_quant_linear(x, weight, bias)


@pytest.mark.parametrize("same_order", [True, False], ids=["shared-g_idx", "g_idx-per-shard"])
def test_layer_holds_the_group_quantized_layout_and_calls_the_platform_op(same_order):
    """After loading, the layer holds GroupQuantWeights (as its parameters, the GPTQ tensors
    gone) and computes them through ``layer.ops.group_quant_linear``: one weight when the
    shards share their act-order g_idx, one per shard when they do not. Each weight,
    dequantized, is the reference's W with its inputs gathered by ``input_order``."""
    rng = np.random.default_rng(5)
    inputs, bits = 128, 4
    shards = [random_module(rng, inputs, rows, bits, 32, False, True, "gptq") for rows in (32, 16)]
    if same_order:
        shards[1]["g_idx"] = shards[0]["g_idx"].copy()
    layer = gptq_layer({"bits": bits, "group_size": 32, "sym": False, "desc_act": True}, inputs, shards, torch.float32)
    names = {name for name, _ in layer.named_parameters()}
    assert names == (
        {"qweight", "scales", "offsets", "input_order"}
        if same_order
        else {f"{name}_{shard}" for name in ("qweight", "scales", "offsets", "input_order") for shard in (0, 1)}
    )
    layer.ops = RecordingOps()
    x = torch.randn(3, inputs, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        y = layer(x)
    assert len(layer.ops.weights) == (1 if same_order else 2)
    weight = np.concatenate([dequantize(m, bits) for m in shards])  # [48, 128]
    outputs = [(0, 48)] if same_order else [(0, 32), (32, 48)]
    for (first, last), held in zip(outputs, layer.ops.weights):
        assert held.group_size == 32 and held.qweight.dtype == torch.uint8
        order = held.input_order.numpy()
        assert np.array_equal(held.dequantize().double().numpy(), weight[first:last][:, order])
    assert torch.allclose(y.double(), x.double() @ torch.from_numpy(weight).T, rtol=1e-5, atol=1e-5)


def test_groups_of_unequal_sizes():
    """g_idx whose groups hold 64 and 32 inputs (96 inputs in groups of 64) compute exactly in
    runs of 32; groups of 3 and 5 inputs, which no even size divides, are refused by name."""
    rng = np.random.default_rng(6)
    module = random_module(rng, 96, 16, 4, 64, False, False, "gptq_v2")
    assert np.array_equal(np.bincount(module["g_idx"]), [64, 32])
    layer = gptq_layer(
        {"bits": 4, "group_size": 64, "sym": False, "checkpoint_format": "gptq_v2"}, 96, [module], torch.float32
    )
    [(_, _, held)] = layer.group_quant
    assert held.group_size == 32 and held.input_order is None, "in order: no input order"
    with torch.no_grad():
        w_transposed = layer(torch.eye(96, dtype=torch.float32))
    assert torch.equal(w_transposed.double(), torch.from_numpy(dequantize(module, 4, "gptq_v2").T))
    odd = random_module(rng, 8, 8, 4, 4, False, False, "gptq")
    odd["g_idx"] = np.array([0, 0, 0, 1, 1, 1, 1, 1], dtype=np.int32)
    with pytest.raises(ValueError, match=r"groups of 3, 5 inputs, which no even group size divides"):
        gptq_layer({"bits": 4, "group_size": 4, "sym": False}, 8, [odd], torch.float32)
