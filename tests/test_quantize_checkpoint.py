"""``engine quantize``: a prequantized GPTQ copy of a tiny Llama, checked against the GPTQ
format written plainly here (the tensors AutoGPTQ and GPTQModel write per linear module:
``qweight`` int32 [K / 8, N] with eight 4-bit values a word, the lowest bits first, along
the inputs; ``qzeros`` int32 [G, N / 8] with the zero point minus one, packed the same
way along the outputs; ``scales`` float16 [G, N]; ``g_idx`` int32 [K], input k's group;
the weight is ``W[n, k] = scales[g, n] * (q[k, n] - (qzeros[g, n] + 1))``, g = g_idx[k]),
and loaded by the engine with the logits of quantizing the original while loading."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from engine import LLM
from engine.cli import main
from engine.testing.checkpoints import make_tiny_checkpoint

PLUGINS = ["cpu", "llama", "gptq"]
SETTINGS = {"bits": 4, "group_size": 32}
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = [[5, 17, 42, 7, 99, 3], [3, 4, 5], list(range(40, 73))]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A float32 tiny Llama with a tokenizer and a generation config."""
    path = tmp_path_factory.mktemp("quantize") / "tiny-llama"
    make_tiny_checkpoint("LlamaForCausalLM", path, with_tokenizer=True)
    return path


def quantize(source, dst, *options: str) -> None:
    argv = ["quantize", str(source), str(dst), "--quantization", "gptq", "--quantization-config"]
    assert main([*argv, json.dumps(SETTINGS), "--plugins", ",".join(PLUGINS), "--no-progress", *options]) == 0


@pytest.fixture(scope="module")
def quantized(source, tmp_path_factory):
    """``engine quantize`` of the source in float32 and in bfloat16."""
    root = tmp_path_factory.mktemp("quantized")
    for dtype in ("float32", "bfloat16"):
        quantize(source, root / dtype, "--dtype", dtype)
    return root


def make_llm(path, dtype: str, **kwargs) -> LLM:
    return LLM(str(path), plugins=PLUGINS, dtype=dtype, progress=False, kv_cache_memory=0.01, **kwargs)


def unpack_along_rows(words: np.ndarray) -> np.ndarray:
    """[K / 8, N] int32 -> [K, N]: value 8 * i + j is bits 4j..4j+3 of word i."""
    u = words.view(np.uint32)
    return np.stack([(u >> (4 * j)) & 0xF for j in range(8)], axis=1).reshape(-1, words.shape[1])


def unpack_along_columns(words: np.ndarray) -> np.ndarray:
    """[G, N / 8] int32 -> [G, N]."""
    u = words.view(np.uint32)
    return np.stack([(u >> (4 * j)) & 0xF for j in range(8)], axis=2).reshape(words.shape[0], -1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_copy_loads_with_the_logits_of_quantizing_while_loading(source, quantized, dtype):
    prequantized = make_llm(quantized / dtype, dtype)
    assert prequantized.engine.quantizer.name == "gptq" and prequantized.engine.quantizer.prequantized
    on_the_fly = make_llm(source, dtype, quantization="gptq", quantization_config=SETTINGS)
    dense = make_llm(source, dtype)
    for a, b, c in zip(
        prequantized.prompt_logits(PROMPTS), on_the_fly.prompt_logits(PROMPTS), dense.prompt_logits(PROMPTS)
    ):
        assert torch.equal(a, b)
        assert not torch.equal(a, c)  # quantized for real


def test_the_tensors_follow_the_gptq_format(source, quantized):
    original = load_file(source / "model.safetensors")
    saved = load_file(quantized / "float32" / "model.safetensors")
    modules = {name.removesuffix(".weight") for name in original if name.split(".")[-2] in LINEAR}
    assert len(modules) == 2 * len(LINEAR)
    for module in sorted(modules):
        weight = original[f"{module}.weight"].numpy()  # [N, K]
        n, k = weight.shape
        groups = k // SETTINGS["group_size"]
        assert f"{module}.weight" not in saved
        tensors = {key: saved[f"{module}.{key}"] for key in ("qweight", "qzeros", "scales", "g_idx")}
        shapes = {key: (tuple(t.shape), t.dtype) for key, t in tensors.items()}
        assert shapes == {
            "qweight": ((k // 8, n), torch.int32),
            "qzeros": ((groups, n // 8), torch.int32),
            "scales": ((groups, n), torch.float16),
            "g_idx": ((k,), torch.int32),
        }, module
        g_idx = tensors["g_idx"].numpy()
        assert np.array_equal(g_idx, np.arange(k) // SETTINGS["group_size"])
        q = unpack_along_rows(tensors["qweight"].numpy())  # [K, N]
        zeros = unpack_along_columns(tensors["qzeros"].numpy()) + 1  # [G, N]
        scales = tensors["scales"].numpy().astype(np.float64)
        dequantized = scales[g_idx] * (q.astype(np.float64) - zeros[g_idx])  # [K, N]
        # round to nearest: each weight within half a step of its group's grid, give or take the
        # float16 rounding of the step (relative 2**-11) times the at most 8 steps from the zero point
        error = np.abs(dequantized - weight.T.astype(np.float64))
        assert (error <= scales[g_idx] * (0.5 + 8 * 2**-11)).all(), module
        assert (zeros == 8).all()  # symmetric 4-bit: the zero point in the middle of [0, 16)
    kept = sorted(name for name in original if name.split(".")[-2] not in LINEAR)
    assert kept == sorted(name for name in saved if not name.endswith(("qweight", "qzeros", "scales", "g_idx")))
    for name in kept:  # embedding, norms and the LM head as they were
        assert torch.equal(saved[name], original[name]), name


def test_the_copy_carries_the_config_the_tokenizer_and_the_generation_config(source, quantized):
    for dtype in ("float32", "bfloat16"):
        folder = quantized / dtype
        config = json.loads((folder / "config.json").read_text())
        # the whole GPTQ config (other engines read bits, sym and desc_act), the settings given on top
        assert config["quantization_config"] == {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": 32,
            "sym": True,
            "desc_act": False,
            "checkpoint_format": "gptq",
            "lm_head": False,
        }
        del config["quantization_config"]
        assert config == json.loads((source / "config.json").read_text())
        others = sorted(p.name for p in source.iterdir() if p.suffix != ".safetensors" and p.name != "config.json")
        assert "tokenizer.json" in others and "generation_config.json" in others
        for name in others:
            assert (folder / name).read_bytes() == (source / name).read_bytes(), name
        assert sorted(p.name for p in folder.iterdir()) == sorted([*others, "config.json", "model.safetensors"])


def test_a_small_shard_size_writes_an_index_the_engine_loads(source, quantized, tmp_path):
    quantize(source, tmp_path / "sharded", "--dtype", "float32", "--max-shard-size", "0.0001")  # 100 kB
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    whole = load_file(quantized / "float32" / "model.safetensors")
    parts = {}
    for name in files:
        parts.update(load_file(tmp_path / "sharded" / name))
    assert sorted(parts) == sorted(whole) == sorted(index["weight_map"])
    assert all(torch.equal(parts[name], whole[name]) for name in whole)
    a = make_llm(tmp_path / "sharded", "float32").prompt_logits(PROMPTS[:1])[0]
    assert torch.equal(a, make_llm(quantized / "float32", "float32").prompt_logits(PROMPTS[:1])[0])


def test_refusals_say_what_was_found(source, quantized, tmp_path, capsys):
    quantize_argv = ["quantize", str(source), str(quantized / "float32"), "--quantization", "gptq"]
    assert main([*quantize_argv, "--plugins", ",".join(PLUGINS)]) == 1
    assert "exists; engine quantize writes a new directory" in capsys.readouterr().err

    assert main(["quantize", str(quantized / "float32"), str(tmp_path / "again"), "--quantization", "gptq"]) == 1
    err = capsys.readouterr().err
    assert "is already quantized with gptq (quantization_config in its config.json)" in err

    assert main(["quantize", str(source), str(tmp_path / "none")]) == 1
    assert "engine quantize needs --quantization NAME" in capsys.readouterr().err

    argv = ["quantize", str(source), str(tmp_path / "bad"), "--quantization", "gptq", "--plugins", "cpu,llama,gptq"]
    assert main([*argv, "--quantization-config", '{"bits": 3}']) == 1
    assert "bits=3 (--quantization-config) is not supported" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists() and not list(tmp_path.glob(".bad.partial-*"))


def test_biases_and_a_tied_head_come_through(tmp_path):
    """Qwen2: q/k/v biases exported beside their GPTQ tensors, the LM head tied to the embedding."""
    make_tiny_checkpoint("Qwen2ForCausalLM", tmp_path / "qwen2")
    quantize(tmp_path / "qwen2", tmp_path / "gptq", "--dtype", "bfloat16")
    saved = load_file(tmp_path / "gptq" / "model.safetensors")
    assert saved["model.layers.0.self_attn.k_proj.bias"].dtype == torch.bfloat16
    assert not any(name.startswith("lm_head") for name in saved)
    prequantized = make_llm(tmp_path / "gptq", "bfloat16")
    on_the_fly = make_llm(tmp_path / "qwen2", "bfloat16", quantization="gptq", quantization_config=SETTINGS)
    for a, b in zip(prequantized.prompt_logits(PROMPTS), on_the_fly.prompt_logits(PROMPTS)):
        assert torch.equal(a, b)


def test_a_format_of_a_method_writes_that_method_and_format(source, tmp_path):
    """``--quantization compressed-tensors/pack-quantized`` writes a compressed-tensors config
    (``quant_method`` and ``format`` apart, the weight scheme in ``config_groups``) that loads
    back into the same logits as quantizing while loading."""
    plugins = ["cpu", "llama", "compressed_tensors"]
    name = "compressed-tensors/pack-quantized"
    weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": True}
    settings = {"config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}
    argv = ["quantize", str(source), str(tmp_path / "ct"), "--quantization", name, "--dtype", "float32"]
    argv += ["--quantization-config", json.dumps(settings)]
    assert main([*argv, "--plugins", ",".join(plugins), "--no-progress"]) == 0
    written = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    assert written["quant_method"] == "compressed-tensors" and written["format"] == "pack-quantized"
    (group,) = written["config_groups"].values()
    assert group["weights"]["num_bits"] == 4 and group["weights"]["type"] == "int"
    prequantized = LLM(str(tmp_path / "ct"), plugins=plugins, dtype="float32", progress=False, kv_cache_memory=0.01)
    on_the_fly = LLM(
        str(source),
        plugins=plugins,
        dtype="float32",
        progress=False,
        kv_cache_memory=0.01,
        quantization=name,
        quantization_config=settings,
    )
    for a, b in zip(prequantized.prompt_logits(PROMPTS), on_the_fly.prompt_logits(PROMPTS)):
        assert torch.equal(a, b)


def test_a_mixture_of_experts_copy_holds_its_experts_quantized(tmp_path):
    """Qwen3-MoE saved by transformers (stacked experts): the copy holds each expert's projection
    as a GPTQ module (``mlp.experts.<e>.<proj>.qweight``, as GPTQModel writes them), and loads
    with the logits of quantizing while loading."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from engine.config import EngineConfig
    from engine.testing.quantized_experts import MOE_CONFIG, NUM_EXPERTS
    from engine.tools.quantize_checkpoint import quantize_checkpoint

    torch.manual_seed(0)
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**MOE_CONFIG)).to(torch.bfloat16).save_pretrained(tmp_path / "moe")
    settings = {"bits": 4, "group_size": 32}
    config = EngineConfig(
        model=str(tmp_path / "moe"), plugins=["cpu", "llama", "gptq"], quantization="gptq", quantization_config=settings
    )
    written = quantize_checkpoint(config, tmp_path / "moe-gptq", progress=False)
    saved = {}
    for file in written.files:
        saved.update(load_file(tmp_path / "moe-gptq" / file))
    for e in range(NUM_EXPERTS):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert f"model.layers.1.mlp.experts.{e}.{proj}.qweight" in saved
    assert not any(name.endswith(("experts.gate_up_proj", "experts.down_proj")) for name in saved)
    # 2 layers of q, k, v, o and 4 experts x 3 projections
    assert written.num_modules == 2 * (4 + NUM_EXPERTS * 3)
    prompts = [[5, 9, 200, 31], list(range(3, 40))]
    copy = LLM(
        str(tmp_path / "moe-gptq"),
        plugins=["cpu", "llama", "gptq"],
        dtype="bfloat16",
        progress=False,
        kv_cache_memory=0.05,
    )
    on_the_fly = LLM(
        str(tmp_path / "moe"),
        plugins=["cpu", "llama", "gptq"],
        dtype="bfloat16",
        progress=False,
        kv_cache_memory=0.05,
        quantization="gptq",
        quantization_config=settings,
    )
    for a, b in zip(copy.prompt_logits(prompts), on_the_fly.prompt_logits(prompts)):
        assert torch.equal(a, b)
