"""GPTQ mixtures of experts: a tiny Qwen3-MoE whose routed experts are GPTQ modules
(``mlp.experts.<e>.<proj>.qweight`` / ``qzeros`` / ``scales`` / ``g_idx``, as GPTQModel writes
them), run from their packed weights (``Quantizer.get_experts_method``). The reference is the
same model with every quantized weight dequantized by gptq_reference.py, loaded unquantized."""

from __future__ import annotations

import json
import random

import pytest
import torch
from gptq_reference import dequantize
from safetensors.torch import load_file, save_file

from engine import LLM
from engine.interfaces.group_quant import GroupQuantWeight
from engine_gptq.quantizer import GptqQuantizer

PLUGINS = ["cpu", "llama", "gptq"]
SETTINGS = {"bits": 4, "group_size": 32, "sym": False, "desc_act": True, "checkpoint_format": "gptq"}
NUM_EXPERTS = 4
# fp32: the order of the float32 sums; bf16: the dense reference rounds its weights to bf16
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}


def per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stacked expert tensors (transformers 5: ``experts.gate_up_proj`` [E, 2I, hidden],
    ``experts.down_proj`` [E, hidden, I]) as per-expert ``experts.<e>.<proj>.weight``."""
    out = {}
    for name, tensor in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            for e in range(tensor.shape[0]):
                out[f"{name[: -len('gate_up_proj')]}{e}.gate_proj.weight"] = gate[e]
                out[f"{name[: -len('gate_up_proj')]}{e}.up_proj.weight"] = up[e]
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(tensor.shape[0]):
                out[f"{name[: -len('down_proj')]}{e}.down_proj.weight"] = tensor[e]
        else:
            out[name] = tensor
    return out


def quantized_module(name: str) -> bool:
    module = name.removesuffix(".weight")
    last = module.split(".")[-1]
    return name.endswith(".weight") and last in (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )


def save(path, config: dict, tensors: dict) -> None:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors", {"format": "pt"})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(bf16 Qwen3-MoE, its GPTQ checkpoint with GPTQ experts, the GPTQ weights dequantized)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    root = tmp_path_factory.mktemp("gptq-moe")
    config = Qwen3MoeConfig(
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=320,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).to(torch.bfloat16).eval()
    model.save_pretrained(root / "base")
    base_config = json.loads((root / "base" / "config.json").read_text())
    state = per_expert(load_file(root / "base" / "model.safetensors"))
    assert any(".mlp.experts.3.down_proj.weight" in name for name in state)
    quantizer = GptqQuantizer.from_config(SETTINGS, prequantized=False)
    quantized, dequantized = {}, {}
    for name, tensor in state.items():
        if not quantized_module(name):
            quantized[name] = dequantized[name] = tensor
            continue
        module = name.removesuffix(".weight")
        gptq = quantizer.export_weight(tensor, None)
        quantized.update({f"{module}.{key}": value for key, value in gptq.items()})
        dequantized[name] = torch.from_numpy(dequantize({k: v.numpy() for k, v in gptq.items()}, 4)).float()
    save(root / "gptq", {**base_config, "quantization_config": {"quant_method": "gptq", **SETTINGS}}, quantized)
    save(root / "dequantized", base_config, dequantized)
    return root / "base", root / "gptq", root / "dequantized"


def make_llm(path, dtype: str, **kwargs) -> LLM:
    return LLM(str(path), plugins=PLUGINS, dtype=dtype, progress=False, kv_cache_memory=0.05, **kwargs)


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 320) for _ in range(n)] for n in (4, 13, 30)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gptq_experts_run_from_their_packed_weights(checkpoints, dtype):
    _, gptq, dequantized = checkpoints
    llm = make_llm(gptq, dtype)
    experts = llm.engine.model.model.layers[0].mlp.experts
    assert not hasattr(experts, "w13") and not hasattr(experts, "w2"), "the experts keep a dense copy"
    assert len(experts.down) == NUM_EXPERTS and all(isinstance(w, GroupQuantWeight) for w in experts.down)
    assert experts.down[0].qweight.dtype == torch.uint8
    assert all(part.input_order is not None for part in experts.gate_up[0])  # act-order over 2 groups
    held = sum(p.numel() * p.element_size() for p in experts.parameters())
    # under half of the bf16 experts' bytes: 4-bit values, a float32 scale and offset per 32, and
    # (act-order) an int64 input order per part, much for 64 inputs
    assert held < 0.5 * NUM_EXPERTS * 3 * 32 * 64 * 2
    batch = prompts(0)
    for got, want in zip(llm.prompt_logits(batch), make_llm(dequantized, dtype).prompt_logits(batch)):
        error = (got.float() - want.float()).abs().max().item() / want.float().abs().max().item()
        assert error <= TOLERANCE[dtype], f"{dtype}: relative logit difference {error:.2e}"


def test_quantizing_experts_while_loading_matches_the_checkpoint(checkpoints):
    """--quantization gptq on the bf16 checkpoint (stacked experts) holds the very weights of
    the GPTQ checkpoint's per-expert modules."""
    base, gptq, _ = checkpoints
    on_the_fly = make_llm(base, "float32", quantization="gptq", quantization_config=SETTINGS)
    prequantized = make_llm(gptq, "float32")
    for a, b in zip(on_the_fly.engine.model.parameters(), prequantized.engine.model.parameters()):
        assert torch.equal(a, b)
    batch = prompts(1)
    for a, b in zip(on_the_fly.prompt_logits(batch), prequantized.prompt_logits(batch)):
        assert torch.equal(a, b)


def test_quantized_experts_without_a_method_are_refused_by_name(checkpoints, tmp_path):
    """The same tensors with no quantization_config: the dense experts refuse them, naming one."""
    _, gptq, _ = checkpoints
    config = json.loads((gptq / "config.json").read_text())
    del config["quantization_config"]
    tensors = {k: v for k, v in load_file(gptq / "model.safetensors").items() if ".experts." in k or "proj" not in k}
    save(tmp_path / "plain", config, tensors)
    with pytest.raises(
        ValueError, match=r"Expert \d+ \w+_proj\.(qweight|qzeros|scales|g_idx): a quantized expert tensor"
    ):
        make_llm(tmp_path / "plain", "float32")


def test_a_missing_expert_projection_is_named(checkpoints, tmp_path):
    _, gptq, _ = checkpoints
    tensors = {k: v for k, v in load_file(gptq / "model.safetensors").items() if ".mlp.experts.2.up_proj." not in k}
    save(tmp_path / "short", json.loads((gptq / "config.json").read_text()), tensors)
    with pytest.raises(
        ValueError, match=r"did not provide these expert projections: model\.layers\.0\.mlp\.experts\.2\.up_proj"
    ):
        make_llm(tmp_path / "short", "float32")
