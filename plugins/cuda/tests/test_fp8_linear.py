"""FP8 checkpoints as FP8 linear layers (engine_cuda.fp8): the layer's layout against the
checkpoint's scales element by element, fused shards whose rows are not a multiple of the
block, tensor-parallel cuts, the Triton GEMM path under the interpreter, and whole checkpoints
(DeepSeek-V3 block-scaled, compressed-tensors per channel) loaded with the linear layers and
the routed experts kept in FP8, against transformers on the dense weights."""

from __future__ import annotations

import itertools
import json
import os
import random

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined: run them on the CPU

import pytest  # noqa: E402
import torch  # noqa: E402

from engine.distributed.parallel_state import TensorParallel
from engine.interfaces.fp8 import Fp8Weight
from engine.layers.linear import ColumnParallelLinear, MergedLinear, RowParallelLinear  # noqa: E402
from engine.layers.moe import Experts
from engine_cuda.fp8 import (  # noqa: E402
    CompressedTensorsFp8Quantizer,
    Fp8LinearMethod,
    Fp8Quantizer,
    quantize_fp8_blocks,
    write_fp8_checkpoint,
)


def element_reference(q: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Each e4m3 value times the factor of the block holding it, one at a time."""
    out = torch.empty(q.shape)
    for r, c in itertools.product(range(q.shape[0]), range(q.shape[1])):
        out[r, c] = float(q[r, c].float()) * float(scales[r // block[0], c // block[1]])
    return out


def checkpoint_shards(sizes, k, block, seed):
    """Per shard (e4m3 weight, its block scales, the dense weight they stand for)."""
    gen = torch.Generator().manual_seed(seed)
    shards = []
    for rows in sizes:
        q, s = quantize_fp8_blocks(torch.randn(rows, k, generator=gen) / k**0.5, block)
        shards.append((q, s, element_reference(q, s, block)))
    return shards


def fp8_layer(sizes, k, block, bias=False, **kwargs) -> MergedLinear:
    layer = MergedLinear(k, list(sizes), bias, torch.float32)
    layer.set_method(Fp8LinearMethod(block, "weight_scale_inv", prequantized=True, **kwargs))
    return layer


def test_fused_shards_of_uneven_rows_hold_one_factor_per_row_and_compute_the_dequantized_product():
    block = (16, 16)
    sizes, k = (40, 24, 24), 48  # q / k / v: 40 rows is not a multiple of the 16-row block
    shards = checkpoint_shards(sizes, k, block, seed=0)
    layer = fp8_layer(sizes, k, block, bias=True)
    biases = [torch.randn(n) for n in sizes]
    for index, (q, s, _) in enumerate(shards):
        assert not layer.load_checkpoint_tensor("weight", index, q)
        layer.load_checkpoint_tensor("weight_scale_inv", index, s)
        done = layer.load_checkpoint_tensor("bias", index, biases[index])
    assert done and layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.shape == (88, 3)
    layer.method.process_weights_after_loading(layer)
    assert layer.fp8_kernel == "ops"  # on the CPU: the platform's fp8_linear (here the reference ops)
    x = torch.randn(5, k)
    dense = torch.cat([d for _, _, d in shards])
    expected = x @ dense.t() + torch.cat(biases)
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
    # what an FP8-less GPU does: the weight dequantized once
    dense_layer = fp8_layer(sizes, k, block, kernel="dense")
    for index, (q, s, _) in enumerate(shards):
        dense_layer.load_checkpoint_tensor("weight", index, q)
        dense_layer.load_checkpoint_tensor("weight_scale_inv", index, s)
    dense_layer.method.process_weights_after_loading(dense_layer)
    assert dense_layer.weight.dtype == torch.float32 and not hasattr(dense_layer, "weight_scale")
    torch.testing.assert_close(dense_layer.weight, dense, rtol=0, atol=0)


def test_per_channel_and_per_tensor_scales_and_the_errors_that_name_shapes():
    gen = torch.Generator().manual_seed(1)
    k = 32
    weights = [torch.randn(8, k, generator=gen), torch.randn(6, k, generator=gen)]
    per_channel = [w.abs().amax(dim=1, keepdim=True) / 448 for w in weights[:1]]
    per_tensor = [weights[1].abs().max().reshape(1) / 448]
    layer = MergedLinear(k, [8, 6], False, torch.float32)
    layer.set_method(Fp8LinearMethod(None, "weight_scale", prequantized=True))
    dense = []
    for index, (w, s) in enumerate(zip(weights, per_channel + per_tensor)):
        q = (w / s.reshape(-1, 1)).to(torch.float8_e4m3fn)
        layer.load_checkpoint_tensor("weight", index, q)
        layer.load_checkpoint_tensor("weight_scale", index, s)
        dense.append(q.float() * s.reshape(-1, 1))
    layer.method.process_weights_after_loading(layer)
    x = torch.randn(3, k, generator=gen)
    torch.testing.assert_close(layer(x), x @ torch.cat(dense).t(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"\[6, 1\] or one value"):
        layer.load_checkpoint_tensor("weight_scale", 1, torch.ones(3))
    blocked = fp8_layer((8,), k, (4, 16))
    with pytest.raises(ValueError, match=r"has \(2, 2\) scales, the checkpoint \(1, 2\)"):
        blocked.load_checkpoint_tensor("weight_scale_inv", 0, torch.ones(1, 2))
    with pytest.raises(ValueError, match="not float8_e4m3fn.*modules_to_not_convert"):
        blocked.load_checkpoint_tensor("weight", 0, torch.randn(8, k))


@pytest.mark.parametrize("rank", [0, 1])
def test_tensor_parallel_ranks_cut_the_per_row_scales_where_they_cut_the_weight(rank):
    block, k = (16, 32), 64
    tp = TensorParallel(rank=rank, size=2)
    sizes = (48, 40)
    shards = checkpoint_shards(sizes, k, block, seed=2)
    column = ColumnParallelLinear(k, list(sizes), False, torch.float32, tp=tp)
    column.set_method(Fp8LinearMethod(block, "weight_scale_inv", prequantized=True))
    for index, (q, s, _) in enumerate(shards):
        column.load_checkpoint_tensor("weight", index, q)
        column.load_checkpoint_tensor("weight_scale_inv", index, s)
    column.method.process_weights_after_loading(column)
    x = torch.randn(4, k)
    mine = torch.cat([d.chunk(2)[rank] for _, _, d in shards])  # this rank's rows of each shard
    torch.testing.assert_close(column(x), x @ mine.t(), rtol=1e-5, atol=1e-5)

    ((q, s, dense),) = checkpoint_shards((24,), k, block, seed=3)
    row = RowParallelLinear(k, 24, False, torch.float32, tp=tp)
    row.set_method(Fp8LinearMethod(block, "weight_scale_inv", prequantized=True))
    row.load_checkpoint_tensor("weight", 0, q)
    row.load_checkpoint_tensor("weight_scale_inv", 0, s)
    row.method.process_weights_after_loading(row)
    cols = slice(rank * 32, (rank + 1) * 32)  # each rank's inputs: one 32-column scale block
    partial = row.method.apply(row, x[:, cols])
    torch.testing.assert_close(partial, x[:, cols] @ dense[:, cols].t(), rtol=1e-5, atol=1e-5)

    cut = RowParallelLinear(k, 24, False, torch.float32, tp=tp)
    cut.set_method(Fp8LinearMethod((16, 40), "weight_scale_inv", prequantized=True))  # blocks [0, 40), [40, 64)
    with pytest.raises(ValueError, match="cannot be split across 2 tensor-parallel ranks.*40-column scale blocks"):
        cut.load_checkpoint_tensor("weight_scale_inv", 0, torch.ones(2, 2))


@pytest.mark.parametrize("quantize_activations", [False, True], ids=["w8a16", "w8a8"])
def test_the_triton_kernel_path_under_the_interpreter_matches_its_reference(quantize_activations):
    pytest.importorskip("triton")
    from engine_cuda.fp8_gemm import quantize_fp8_groups

    block, sizes, k = (16, 32), (40, 24), 64
    shards = checkpoint_shards(sizes, k, block, seed=4)
    layer = fp8_layer(sizes, k, block, kernel="triton", quantize_activations=quantize_activations)
    for index, (q, s, _) in enumerate(shards):
        layer.load_checkpoint_tensor("weight", index, q)
        layer.load_checkpoint_tensor("weight_scale_inv", index, s)
    layer.method.process_weights_after_loading(layer)
    x = torch.randn(5, k)
    dense = torch.cat([d for _, _, d in shards])
    if quantize_activations:  # the activations as the kernel sees them: e4m3 per row and 32 columns
        xq, xs = quantize_fp8_groups(x, 32)
        x_seen = xq.float() * xs.repeat_interleave(32, dim=1)
    else:
        x_seen = x
    torch.testing.assert_close(layer(x), x_seen @ dense.t(), rtol=1e-5, atol=1e-5)


def test_the_quantizers_read_their_configs_and_skip_what_checkpoints_leave_dense():
    blocks = Fp8Quantizer.from_config({"quant_method": "fp8", "weight_block_size": [128, 128]}, prequantized=True)
    assert blocks.get_linear_method("model.layers.0.self_attn.q_a_proj").scale_name == "weight_scale_inv"
    assert blocks.get_linear_method("lm_head") is None and blocks.get_linear_method("model.layers.3.mlp.gate") is None
    per_tensor = Fp8Quantizer.from_config({"quant_method": "fp8", "activation_scheme": "static"}, prequantized=True)
    method = per_tensor.get_linear_method("model.layers.0.mlp.down_proj")
    assert method.block is None and method.scale_name == "weight_scale"
    skip = Fp8Quantizer.from_config({"quant_method": "fp8", "modules_to_not_convert": ["mlp"]}, prequantized=True)
    assert skip.get_linear_method("model.layers.0.mlp.gate_up_proj") is None
    with pytest.raises(ValueError, match="fmt 'e5m2'"):
        Fp8Quantizer.from_config({"fmt": "e5m2"}, prequantized=True)

    groups = {
        "group_0": {"format": "float-quantized", "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}
    }
    config = {
        "quant_method": "compressed-tensors",
        "config_groups": groups,
        "ignore": ["lm_head", "re:.*\\.mlp\\.down_proj$"],
    }
    assert CompressedTensorsFp8Quantizer.declines(config) is None
    ct = CompressedTensorsFp8Quantizer.from_config(config, prequantized=True)
    assert ct.get_linear_method("model.layers.0.mlp.down_proj") is None
    assert ct.get_linear_method("model.layers.0.self_attn.qkv_proj").block is None
    mxfp4 = {"quant_method": "compressed-tensors", "config_groups": {"g": {"format": "mxfp4-pack-quantized"}}}
    assert "mxfp4-pack-quantized" in CompressedTensorsFp8Quantizer.declines(mxfp4)
    with pytest.raises(ValueError, match="--quantization fp8"):
        CompressedTensorsFp8Quantizer.from_config(config, prequantized=False)


# whole checkpoints


def quantize_deepseek_checkpoint(path, reference_path, block):
    """The tiny DeepSeek-V3 checkpoint at ``path`` with every projection (experts' too) in
    block-scaled FP8; transformers' model on the dense weights they stand for."""
    import transformers

    write_fp8_checkpoint(path, reference_path, block, ("proj.weight", "proj_with_mqa.weight"))
    config = json.loads((path / "config.json").read_text())
    return getattr(transformers, config["architectures"][0]).from_pretrained(reference_path, dtype=torch.float32).eval()


def test_deepseek_fp8_checkpoint_keeps_fp8_linear_layers_and_fp8_experts(tmp_path):
    """The FP8 quantizer serving the CPU (its layers compute with engine-cpu's fp8_linear):
    attention and shared-expert projections stay e4m3, so do the routed experts, and
    the logits are transformers' on the dense weights; so are the greedy tokens, whose decode
    rows run the kernel that widens the e4m3 bytes in registers."""
    from engine import LLM
    from engine.testing.checkpoints import make_tiny_checkpoint

    path = tmp_path / "fp8"
    make_tiny_checkpoint("DeepseekV3ForCausalLM", path)
    hf_model = quantize_deepseek_checkpoint(path, tmp_path / "dense", (16, 16))
    llm = LLM(str(path), plugins=["cpu", "deepseek_v4", "cuda"], dtype="float32", kv_cache_memory=0.05, progress=False)
    setup = llm.engine.setup
    assert setup.quantizer.name == "fp8" and setup.dequantizer.keep_quantized
    assert setup.dequantizer.kept > 0
    model = llm.engine.model
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    assert experts and all(isinstance(w, Fp8Weight) for m in experts for w in m.down)
    fp8_layers = [m for m in model.modules() if isinstance(m, MergedLinear) and isinstance(m.method, Fp8LinearMethod)]
    assert fp8_layers and all(m.weight.dtype == torch.float8_e4m3fn and m.fp8_kernel == "ops" for m in fp8_layers)
    rng = random.Random(0)
    batch = [[rng.randrange(3, 320) for _ in range(n)] for n in (5, 19)]
    for prompt, logits in zip(batch, llm.prompt_logits(batch)):
        with torch.no_grad():
            reference = hf_model(torch.tensor([prompt])).logits[0]
        assert (logits - reference).abs().max().item() <= 1e-4 * max(1.0, reference.abs().max().item())
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for prompt, output in zip(batch, llm.generate(batch, params, use_tqdm=False)):
        with torch.no_grad():
            want = hf_model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, min_new_tokens=8)
        assert output.outputs[0].token_ids == want[0, len(prompt) :].tolist()


def quantize_llama_per_channel(path, reference_path):
    """The tiny Llama checkpoint at ``path`` as compressed-tensors ``float-quantized``: every
    projection e4m3 with a factor per output channel and a static ``input_scale``."""
    import shutil

    import transformers
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    shutil.copytree(path, reference_path)
    out, dense = {}, dict(tensors)
    for name, tensor in tensors.items():
        if name.endswith("proj.weight"):
            scale = tensor.abs().amax(dim=1, keepdim=True) / 448
            q = (tensor / scale).to(torch.float8_e4m3fn)
            prefix = name.removesuffix(".weight")
            out[name], out[prefix + ".weight_scale"], out[prefix + ".input_scale"] = q, scale, torch.tensor([0.01])
            dense[name] = q.float() * scale
        else:
            out[name] = tensor
    save_file(out, str(path / "model.safetensors"))
    save_file(dense, str(reference_path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    weights = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": {"format": "float-quantized", "targets": ["Linear"], "weights": weights}},
        "ignore": ["lm_head"],
    }
    (path / "config.json").write_text(json.dumps(config))
    return transformers.LlamaForCausalLM.from_pretrained(reference_path, dtype=torch.float32).eval()


@pytest.mark.parametrize("kept", [False, True], ids=["dequantized", "fp8-layers"])
def test_compressed_tensors_fp8_llama_matches_transformers(tmp_path, kept):
    """Without the FP8 quantizer's plugin the checkpoint loads dequantized; with it the layers
    stay e4m3 and compute with the CPU platform's fp8_linear. Both give transformers' logits on
    the dense weights."""
    from engine import LLM
    from engine.testing.checkpoints import make_tiny_checkpoint

    path = tmp_path / "fp8"
    make_tiny_checkpoint("LlamaForCausalLM", path)
    hf_model = quantize_llama_per_channel(path, tmp_path / "dense")
    plugins = ["cpu", "llama", "cuda"] if kept else ["cpu", "llama"]
    llm = LLM(str(path), plugins=plugins, dtype="float32", kv_cache_memory=0.05, progress=False)
    dequantizer = llm.engine.setup.dequantizer
    assert dequantizer.dropped > 0 and (dequantizer.kept > 0) == kept
    layers = [
        m for m in llm.engine.model.modules() if isinstance(m, MergedLinear) and isinstance(m.method, Fp8LinearMethod)
    ]
    assert bool(layers) == kept
    rng = random.Random(1)
    batch = [[rng.randrange(3, 250) for _ in range(n)] for n in (4, 17)]
    for prompt, logits in zip(batch, llm.prompt_logits(batch)):
        with torch.no_grad():
            reference = hf_model(torch.tensor([prompt])).logits[0]
        assert (logits - reference).abs().max().item() <= 1e-4 * max(1.0, reference.abs().max().item())


def test_the_platform_fp8_linear_runs_the_triton_gemm_for_16_bit_activations(monkeypatch):
    """engine-cuda's layer ops (what FP8 routed experts compute with): bf16 activations through
    the Triton GEMM, here under the interpreter, within LayerOps.fp8_linear's contract of the
    dequantized product (the weight's tiles rounded to bf16: 2^-8 of |x| @ |W s|^T, and the
    output's own bf16 rounding); float32 activations take the reference itself."""
    pytest.importorskip("triton")
    import engine_cuda.fp8_gemm as fp8_gemm
    from engine.interfaces.ops import REFERENCE_OPS
    from engine_cuda.fp8 import per_row_scales
    from engine_cuda.layer_ops import CudaLayerOps

    calls = []
    kernel = fp8_gemm.fp8_block_linear
    monkeypatch.setattr(fp8_gemm, "fp8_block_linear", lambda *a, **kw: calls.append(kw) or kernel(*a, **kw))
    gen = torch.Generator().manual_seed(5)
    q, block_scales = quantize_fp8_blocks(torch.randn(40, 64, generator=gen), (16, 32))
    scales = per_row_scales("w", block_scales, 40, 64, (16, 32))
    x, bias = torch.randn(5, 64, generator=gen), torch.randn(40, generator=gen)
    ops = CudaLayerOps()
    got = ops.fp8_linear(x.bfloat16(), q, scales, 32, bias.bfloat16())
    assert len(calls) == 1 and calls[0]["quantize_activations"] is False
    dense = q.double() * scales.double().repeat_interleave(32, dim=1)
    xb = x.bfloat16().double()
    exact = xb @ dense.T + bias.bfloat16().double()
    bound = 2.0**-8 * (xb.abs() @ dense.abs().T) + 2.0**-8 * exact.abs() + 1e-6
    assert ((got.double() - exact).abs() <= bound).all()
    assert torch.equal(ops.fp8_linear(x, q, scales, 32, bias), REFERENCE_OPS.fp8_linear(x, q, scales, 32, bias))
    assert len(calls) == 1  # float32 activations: the reference
