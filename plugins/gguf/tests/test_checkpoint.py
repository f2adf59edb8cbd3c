"""GGUF checkpoints through the engine: tiny Llama, Qwen2 and Qwen3 models written as GGUF files
(F32, BF16, Q8_0, Q4_K and llama.cpp's Q4_K_M mix) by ``engine.bench.gguf_export``, loaded from
the file alone (config and tokenizer from its metadata) with their quantized weights kept
quantized.

References: the F32 file against transformers on the original checkpoint; every other file
against transformers loading the same GGUF (``from_pretrained(..., gguf_file=...)``, which
dequantizes it with the ``gguf`` package's numpy code and undoes Llama's q/k permutation its
own way), in float32. The engine's layers compute the very float32 weights transformers
dequantizes, so the logits differ only by the order of the float32 sums: within 1e-5 of the
largest logit (measured below 1e-6).
"""

from __future__ import annotations

import random

import gguf
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from engine import LLM, SamplingParams
from engine.bench.gguf_export import cached_gguf, write_gguf
from engine.errors import SelectionError
from engine.interfaces.group_quant import GroupQuantWeight
from engine.model_loader.checkpoint import resolve_model_path
from engine.testing.checkpoints import make_tiny_checkpoint
from engine.tokenizer import load_tokenizer

PLUGINS = ["cpu", "llama", "gguf"]
TOLERANCE = 1e-5
# k-quant blocks are 256 inputs: every linear layer's inputs (hidden, heads x head_dim, intermediate) are
# multiples; a rope base and norm epsilon other than the defaults, so that reading them is checked
SIZES = {"hidden_size": 256, "intermediate_size": 512, "rms_norm_eps": 1e-5}
ROPE = {"rope_type": "default", "rope_theta": 50000.0}
# Llama 3.1's rope scaling, which a GGUF holds as a rope_freqs tensor
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0}
LLAMA3_ROPE |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Numbers like 12345 and symbols like #, @ and % appear too.",
    "  two spaces, a\nnewline, ünïcödé and 日本語",
    "</s> spelled out, <s> too",
]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """name -> (GGUF path, the original checkpoint's directory, its HF model)."""
    root = tmp_path_factory.mktemp("gguf")
    found = {}
    for name, arch, overrides in [
        ("LlamaForCausalLM", "LlamaForCausalLM", {"rope_parameters": ROPE}),
        ("Llama3", "LlamaForCausalLM", {"rope_parameters": LLAMA3_ROPE}),
        ("Qwen2ForCausalLM", "Qwen2ForCausalLM", {"rope_parameters": ROPE}),  # tied output head, q/k/v biases
        ("Qwen3ForCausalLM", "Qwen3ForCausalLM", {"rope_parameters": ROPE, "head_dim": 64}),  # q/k norms
    ]:
        base = root / name
        model = make_tiny_checkpoint(arch, base, with_tokenizer=True, **SIZES, **overrides)
        wanted = {
            "LlamaForCausalLM": [("F32", "float32", None), ("F16", "float16", None), ("BF16", "bfloat16", None)]
            + [("Q8_0", "float32", "Q8_0"), ("Q4_K_M", "float32", "Q4_K_M")],
            "Llama3": [("F32", "float32", None)],
            "Qwen2ForCausalLM": [("Q8_0", "float32", "Q8_0")],
            "Qwen3ForCausalLM": [("Q4_K", "float32", "Q4_K")],
        }[name]
        for label, dtype, quantization in wanted:
            path = write_gguf(base, root / f"{name}-{label}.gguf", dtype, quantization=quantization, tokenizer=True)
            found[f"{name}-{label}"] = (path, base, model)
    return found


def make_llm(path, **kwargs) -> LLM:
    return LLM(str(path), plugins=PLUGINS, dtype="float32", progress=False, kv_cache_memory=0.05, **kwargs)


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 320) for _ in range(n)] for n in (3, 11, 25)]


def hf_logits(model, token_ids: list[list[int]]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(torch.tensor([ids])).logits[0] for ids in token_ids]


def from_gguf(path, base):
    """transformers' own GGUF loading of ``path`` (the checkpoint's config: transformers' GGUF
    config mapping has no Qwen3 head_dim)."""
    config = AutoConfig.from_pretrained(base)
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=config, dtype=torch.float32)


def assert_logits_match(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    for g, w in zip(got, want, strict=True):
        error = ((g.float() - w.float()).abs().max() / w.float().abs().max()).item()
        assert error <= TOLERANCE, f"{what}: relative logit difference {error:.2e}"


def quantized_parts(layer) -> list[GroupQuantWeight]:
    parts = [weight for _, _, weight in layer.gguf_parts]
    assert all(isinstance(w, GroupQuantWeight) for w in parts), parts
    return parts


def test_f32_file_matches_the_original_checkpoint(files):
    path, _, model = files["LlamaForCausalLM-F32"]
    llm = make_llm(path)
    config = llm.engine.setup.raw_config
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps"):
        assert config[key] == getattr(model.config, key), key
    assert config["rope_theta"] == model.config.rope_parameters["rope_theta"] == 50000.0
    ids = prompts(0)
    assert_logits_match(llm.prompt_logits(ids), hf_logits(model, ids), "F32 GGUF")


def test_llama3_rope_scaling_is_read_from_rope_freqs(files):
    """A Llama 3.1 GGUF scales its rope by a rope_freqs tensor: the config gets the llama3 rope
    parameters it encodes, and the logits match the original checkpoint's."""
    path, _, model = files["Llama3-F32"]
    llm = make_llm(path)
    assert llm.engine.setup.raw_config["rope_scaling"] == {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
    ids = prompts(4)
    assert_logits_match(llm.prompt_logits(ids), hf_logits(model, ids), "Llama 3.1 rope")


@pytest.mark.parametrize(
    "name", ["LlamaForCausalLM-F16", "LlamaForCausalLM-BF16", "LlamaForCausalLM-Q8_0", "Qwen2ForCausalLM-Q8_0"]
)
def test_logits_match_transformers_on_the_same_file(files, name):
    path, base, _ = files[name]
    llm = make_llm(path)
    ids = prompts(1)
    assert_logits_match(llm.prompt_logits(ids), hf_logits(from_gguf(path, base), ids), name)
    layers = llm.engine.model.model.layers
    if name.endswith("Q8_0"):
        [weight] = quantized_parts(layers[0].self_attn.qkv_proj)
        assert (weight.bits, weight.group_size, weight.out_features) == (8, 32, 4 * 64 + 2 * 2 * 64)
        assert weight.qweight is layers[0].self_attn.qkv_proj.qweight, "the weight is held as a parameter"
        assert not hasattr(layers[0].mlp.down_proj, "weight"), "the layer keeps a dense copy"
    if name.startswith("Qwen2"):
        assert llm.engine.setup.raw_config["tie_word_embeddings"] is True
        head = llm.engine.model.lm_head
        assert head.weight is llm.engine.model.model.embed_tokens.weight, "the head shares the embedding"


def test_q4_k_m_keeps_its_mix_of_types(files):
    """Q4_K layers, Q6_K output head and (llama.cpp's rule for two layers) Q6_K attn_v and
    ffn_down in layer 1: the fused q/k/v of layer 1 holds a 4-bit part and a 6-bit one."""
    path, base, _ = files["LlamaForCausalLM-Q4_K_M"]
    reader = gguf.GGUFReader(str(path))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["output.weight"] == "Q6_K" and types["blk.1.attn_v.weight"] == "Q6_K"
    assert types["blk.0.attn_v.weight"] == "Q4_K" and types["blk.1.attn_q.weight"] == "Q4_K"
    llm = make_llm(path)
    model = llm.engine.model
    [head] = quantized_parts(model.lm_head)
    assert (head.bits, head.group_size, head.super_group) == (6, 16, 16)
    assert [(w.bits, w.group_size) for w in quantized_parts(model.model.layers[0].self_attn.qkv_proj)] == [(4, 32)]
    layer1 = [(w.bits, w.group_size, w.out_features) for w in quantized_parts(model.model.layers[1].self_attn.qkv_proj)]
    assert layer1 == [(4, 32, 4 * 64 + 2 * 64), (6, 16, 2 * 64)]
    ids = prompts(2)
    assert_logits_match(llm.prompt_logits(ids), hf_logits(from_gguf(path, base), ids), "Q4_K_M")


def test_qwen3_q4_k_matches_transformers(files):
    path, base, _ = files["Qwen3ForCausalLM-Q4_K"]
    llm = make_llm(path)
    config = llm.engine.setup.raw_config
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["head_dim"] == 64
    assert config["quantization_config"] == {"quant_method": "gguf", "types": ["Q4_K"], "output_quantized": True}
    ids = prompts(3)
    assert_logits_match(llm.prompt_logits(ids), hf_logits(from_gguf(path, base), ids), "Qwen3 Q4_K")


def test_tokenizer_from_the_metadata_matches_the_checkpoints(files):
    path, base, _ = files["LlamaForCausalLM-Q8_0"]
    ours, theirs = load_tokenizer(path), AutoTokenizer.from_pretrained(base)
    for text in TEXTS:
        ids = theirs.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == theirs.decode(ids) == text
    assert (ours.bos_token, ours.eos_token) == ("<s>", "</s>")
    llm = make_llm(path)
    assert llm.engine.eos_token_ids == frozenset({2})
    [output] = llm.generate(TEXTS[0], SamplingParams(max_tokens=2), use_tqdm=False)
    assert output.prompt_token_ids == theirs.encode(TEXTS[0]) and output.outputs[0].token_ids


def test_a_directory_holding_one_gguf_loads_it(files, tmp_path):
    path, _, _ = files["LlamaForCausalLM-Q8_0"]
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / path.name).symlink_to(path)
    assert resolve_model_path(str(folder)) == folder / path.name
    (folder / "other.gguf").symlink_to(path)
    with pytest.raises(FileNotFoundError, match="several GGUF files .*other.gguf.*pass the path of the one to load"):
        resolve_model_path(str(folder))


def test_without_the_plugin_the_error_says_to_install_it(files):
    path, _, _ = files["LlamaForCausalLM-Q8_0"]
    with pytest.raises(SelectionError, match=r"quantized with 'gguf'.*install engine-gguf \(pip install engine-gguf\)"):
        LLM(str(path), plugins=["cpu", "llama"], dtype="float32", progress=False)


def test_quantized_files_are_cached_beside_the_checkpoint(files, tmp_path):
    """``cached_gguf`` with a quantization writes once, named by it, apart from the bf16 file."""
    _, base, _ = files["LlamaForCausalLM-Q8_0"]
    checkpoint = tmp_path / "tiny"
    checkpoint.mkdir()
    for name in ("config.json", "model.safetensors"):
        (checkpoint / name).symlink_to(base / name)
    first = cached_gguf(checkpoint, "bfloat16", "Q4_K_M")
    assert first.parent == tmp_path and first.name.endswith(".q4_k_m.gguf")
    stamp = first.stat().st_mtime_ns
    assert cached_gguf(checkpoint, "bfloat16", "Q4_K_M") == first and first.stat().st_mtime_ns == stamp
    assert cached_gguf(checkpoint, "bfloat16") != first
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(first)).tensors}
    assert types["output.weight"] == "Q6_K" and types["blk.0.ffn_up.weight"] == "Q4_K"
