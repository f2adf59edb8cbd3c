"""GGUF checkpoints of the mixture-of-experts and fused-projection families: tiny Qwen3-MoE
(``qwen3moe``), Mixtral (``llama`` with ``llama.expert_count``) and Phi-3 (``phi3``: fused
``attn_qkv`` and gate+up ``ffn_up``, LongRoPE as ``rope_factors_long/short``) models written by
``engine.bench.gguf_export`` in F32, Q8_0 and Q4_K, loaded from the file alone.

References: the F32 file against transformers on the original checkpoint; a quantized file
against transformers on the original checkpoint with every weight the file quantizes replaced
by its round trip through the file's blocks: each row quantized and dequantized with the
``gguf`` package's numpy code (Q8_0), or quantized by the writer and dequantized by ``gguf``
(Q4_K). Blocks run along a weight's inputs, one row at a time, so the round trip of transformers'
own layout (fused q/k/v, stacked experts) is the file's. The router stays float32, as llama.cpp
keeps it. Logits within 1e-5 of the largest (float32 sums in another order). That the files are
laid out as llama.cpp's (stacked experts, fused projections, Gemma's norms stored as 1 + weight)
is checked by transformers' own GGUF loading of them, which gives the round trip's model exactly
(Qwen3-MoE, Phi-3, Gemma 3; transformers reads no Mixtral GGUF).
"""

from __future__ import annotations

import copy
import random

import gguf
import numpy as np
import pytest
import torch
import transformers

from engine import LLM
from engine.bench.gguf_export import model_shape, write_gguf
from engine.interfaces.group_quant import GroupQuantWeight
from engine.model_loader.gguf import gguf_config
from engine.model_loader.gguf_quantize import quantize_blocks
from engine.testing.checkpoints import make_tiny_tokenizer, randomize_constant_parameters

PLUGINS = ["cpu", "llama", "gemma", "gguf"]
TOLERANCE = 1e-5
VOCAB = 320
# every linear layer's inputs a multiple of 256, so that the k-quants apply; rope base and norm
# epsilon other than the defaults, so that reading them is checked
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=None,
)
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 20000.0,
    "long_factor": [1.0 + 0.25 * i for i in range(16)],
    "short_factor": [1.0 + 0.05 * i for i in range(16)],
    "original_max_position_embeddings": 64,
    "partial_rotary_factor": 0.5,
}
GEMMA3_ROPE = {
    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
}
MODELS = {
    # experts in every layer, their top-k weights renormalised (llama.cpp's qwen3moe always does)
    "Qwen3Moe": (
        "Qwen3MoeForCausalLM",
        dict(head_dim=64, intermediate_size=512, moe_intermediate_size=256, num_experts=4, num_experts_per_tok=2)
        | dict(norm_topk_prob=True, rope_parameters={"rope_type": "default", "rope_theta": 50000.0}),
    ),
    "Mixtral": (
        "MixtralForCausalLM",
        dict(intermediate_size=256, num_local_experts=4, num_experts_per_tok=2, sliding_window=None)
        | dict(rope_parameters={"rope_type": "default", "rope_theta": 50000.0}),
    ),
    "Phi3": (
        "Phi3ForCausalLM",
        dict(intermediate_size=256, sliding_window=None)
        | dict(rope_parameters={"rope_type": "default", "rope_theta": 50000.0, "partial_rotary_factor": 0.5}),
    ),
    # llama.cpp's Gemma 3: every sixth layer global (linear rope scaling there, base 10000 on the
    # local ones), a window shorter than the prompts, queries scaled by head_dim, norms of 1 + weight
    # stored as the sum, a tied output head; a final logit cap
    "Gemma3": (
        "Gemma3ForCausalLM",
        dict(intermediate_size=256, num_hidden_layers=6, head_dim=64, query_pre_attn_scalar=64, sliding_window=8)
        | dict(layer_types=["sliding_attention"] * 5 + ["full_attention"], final_logit_softcapping=30.0)
        | dict(tie_word_embeddings=True, rope_parameters=GEMMA3_ROPE),
    ),
    # LongRoPE over half of each head (16 factors; prompts within the original 64 positions, where
    # the short factors apply), a sliding window shorter than the prompts
    "Phi3LongRope": (
        "Phi3ForCausalLM",
        dict(intermediate_size=256, sliding_window=8, rope_parameters=LONGROPE, original_max_position_embeddings=64),
    ),
}
# the quantized files: Q4_K for Qwen3-MoE and Gemma 3 only (Mixtral's experts and Phi-3's split rows
# take the paths Qwen3-MoE's do), to keep the file fast
QUANTIZED = {"Qwen3Moe": ["Q8_0", "Q4_K"], "Mixtral": ["Q8_0"], "Phi3": ["Q8_0"], "Gemma3": ["Q8_0", "Q4_K"]}
ROUTERS = ("mlp.gate.weight",)  # the routers llama.cpp keeps in float32


def from_gguf(path, base):
    """transformers' own GGUF loading of ``path``, with the checkpoint's config (transformers'
    GGUF config mapping leaves out fields such as Qwen3-MoE's expert size)."""
    config = transformers.AutoConfig.from_pretrained(base)
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, config=config, dtype=torch.float32
    )


def make_model(architecture: str, path, **overrides):
    model_class = getattr(transformers, architecture)
    config = model_class.config_class(**{**COMMON, **overrides})
    torch.manual_seed(0)
    model = model_class(config).eval()
    randomize_constant_parameters(model, 1)
    model.save_pretrained(path)
    make_tiny_tokenizer(VOCAB).save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """name -> (GGUF path, the HF model on the original weights)."""
    root = tmp_path_factory.mktemp("gguf_families")
    found = {}
    for name, (architecture, overrides) in MODELS.items():
        model = make_model(architecture, root / name, **overrides)
        kinds = ["F32", *QUANTIZED.get(name, ())]
        for kind in kinds:
            quantization = None if kind == "F32" else kind
            path = write_gguf(root / name, root / f"{name}-{kind}.gguf", "float32", quantization=quantization)
            found[f"{name}-{kind}"] = (path, model, root / name)
    return found


def round_trip(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """``weight``'s values after the file's blocks: each row (along the last dimension, the inputs)
    quantized and dequantized."""
    rows = weight.detach().float().reshape(-1, weight.shape[-1]).numpy()
    ggml_type = getattr(gguf.GGMLQuantizationType, kind)
    blocks = gguf.quants.quantize(rows, ggml_type) if kind == "Q8_0" else quantize_blocks(rows, kind)
    values = gguf.quants.dequantize(blocks, ggml_type)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(weight.shape)


def quantized_reference(model, kind: str):
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if param.dim() >= 2 and not name.endswith(ROUTERS):
                param.copy_(round_trip(param, kind))
    return reference


def make_llm(path) -> LLM:
    return LLM(str(path), plugins=PLUGINS, dtype="float32", progress=False, kv_cache_memory=0.05)


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (3, 11, 25)]


def hf_logits(model, token_ids: list[list[int]]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(torch.tensor([ids])).logits[0] for ids in token_ids]


def assert_logits_match(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    for g, w in zip(got, want, strict=True):
        error = ((g.float() - w.float()).abs().max() / w.float().abs().max()).item()
        assert error <= TOLERANCE, f"{what}: relative logit difference {error:.2e}"


def check_file(files, name: str, seed: int):
    path, model, _ = files[name]
    kind = name.rsplit("-", 1)[1]
    llm = make_llm(path)
    reference = model if kind == "F32" else quantized_reference(model, kind)
    ids = prompts(seed)
    assert_logits_match(llm.prompt_logits(ids), hf_logits(reference, ids), name)
    return llm


def test_config_from_the_metadata(files):
    """The config the metadata gives: experts, experts a token, the experts' size, Mixtral from a
    ``llama`` file with experts, Phi-3's partial rotary factor, LongRoPE and sliding window."""
    qwen = gguf_config(files["Qwen3Moe-Q8_0"][0])
    assert qwen["architectures"] == ["Qwen3MoeForCausalLM"] and qwen["model_type"] == "qwen3_moe"
    assert (qwen["num_experts"], qwen["num_experts_per_tok"], qwen["moe_intermediate_size"]) == (4, 2, 256)
    assert (qwen["intermediate_size"], qwen["norm_topk_prob"], qwen["head_dim"]) == (512, True, 64)
    mixtral = gguf_config(files["Mixtral-F32"][0])
    assert mixtral["architectures"] == ["MixtralForCausalLM"] and mixtral["model_type"] == "mixtral"
    assert (mixtral["num_local_experts"], mixtral["num_experts_per_tok"], mixtral["intermediate_size"]) == (4, 2, 256)
    phi3 = gguf_config(files["Phi3-F32"][0])
    assert phi3["architectures"] == ["Phi3ForCausalLM"] and phi3["partial_rotary_factor"] == 0.5
    assert phi3["sliding_window"] is None and "rope_scaling" not in phi3
    long = gguf_config(files["Phi3LongRope-F32"][0])
    assert long["sliding_window"] == 8 and long["original_max_position_embeddings"] == 64
    gemma = gguf_config(files["Gemma3-Q4_K"][0])
    assert gemma["architectures"] == ["Gemma3ForCausalLM"] and gemma["model_type"] == "gemma3_text"
    assert gemma["layer_types"] == MODELS["Gemma3"][1]["layer_types"] and gemma["sliding_window"] == 8
    assert gemma["rope_parameters"] == GEMMA3_ROPE and gemma["tie_word_embeddings"] is True
    assert (gemma["query_pre_attn_scalar"], gemma["final_logit_softcapping"]) == (64, 30.0)
    rope = long["rope_scaling"]
    assert rope["rope_type"] == "longrope" and rope["original_max_position_embeddings"] == 64
    for part in ("long_factor", "short_factor"):  # float32 in the file
        assert np.array_equal(np.float32(rope[part]), np.float32(LONGROPE[part])), part
    assert rope["attention_factor"] == pytest.approx((1 + np.log(256 / 64) / np.log(64)) ** 0.5)


@pytest.mark.parametrize("family", ["Qwen3Moe", "Mixtral", "Phi3", "Phi3LongRope", "Gemma3"])
def test_f32_file_matches_the_original_checkpoint(files, family):
    check_file(files, f"{family}-F32", 0)


@pytest.mark.parametrize("family, kind", [(family, kind) for family, kinds in QUANTIZED.items() for kind in kinds])
def test_quantized_file_matches_its_round_trip(files, family, kind):
    """The attention, a dense MLP and the routed experts stay in their blocks."""
    llm = check_file(files, f"{family}-{kind}", 1)
    layer = llm.engine.model.model.layers[0]
    parts = [weight for _, _, weight in layer.self_attn.qkv_proj.gguf_parts]
    bits = {"Q8_0": (8, 32), "Q4_K": (4, 32)}[kind]
    assert all(isinstance(w, GroupQuantWeight) and (w.bits, w.group_size) == bits for w in parts), parts
    if family in ("Phi3", "Gemma3"):
        assert [(w.bits, w.group_size) for _, _, w in layer.mlp.gate_up_proj.gguf_parts] == [bits]
    else:
        experts = layer.mlp.experts
        assert not hasattr(experts, "w13"), "the experts were dequantized"
        held = [w for parts in experts.gate_up for w in parts] + list(experts.down)
        assert all(isinstance(w, GroupQuantWeight) and (w.bits, w.group_size) == bits for w in held), held


@pytest.mark.parametrize("family", ["Qwen3Moe", "Phi3", "Gemma3"])
def test_transformers_reads_the_files_as_llama_cpp_files(files, family):
    path, model, base = files[f"{family}-Q8_0"]
    ids = prompts(2)
    want = hf_logits(quantized_reference(model, "Q8_0"), ids)
    assert_logits_match(hf_logits(from_gguf(path, base), ids), want, f"transformers on {family}-Q8_0")


@pytest.mark.parametrize(
    ("family", "change", "message"),
    [
        ("Qwen3Moe", {"mlp_only_layers": [1]}, "experts in every layer"),
        ("Qwen3Moe", {"norm_topk_prob": False}, "renormalises the top-k"),
        ("Gemma3", {"layer_types": ["sliding_attention", "full_attention"] * 3}, "every 6th layer global"),
        ("Gemma3", {"query_pre_attn_scalar": 24}, "scales the queries by 64"),
        ("Gemma3", {"rope_parameters": GEMMA3_ROPE | {"sliding_attention": {"rope_theta": 700.0}}}, "base 10000"),
    ],
)
def test_the_writer_refuses_what_llama_cpp_would_compute_otherwise(family, change, message):
    architecture, overrides = MODELS[family]
    config = getattr(transformers, architecture).config_class(**{**COMMON, **overrides, **change}).to_dict()
    config["architectures"] = [architecture]
    with pytest.raises(ValueError, match=message):
        model_shape(config)
