"""gpt-oss checkpoints with MXFP4 experts (``quant_method: "mxfp4"``: ``X_blocks`` and
``X_scales``), computed from their MXFP4 values (engine-gpt-oss's ``mxfp4`` quantizer): a tiny
one, quantized here as the format is written, against transformers with the experts its own
MXFP4 conversion gives."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file, save_file
from tiny_gpt_oss import make_gpt_oss_checkpoint

from engine import LLM
from engine.testing.generation import random_prompts

# e2m1 code -> value (bit 3 the sign, bits 2-1 the exponent, bit 0 the mantissa)
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
GROUP = 32  # values sharing one power-of-two scale


def quantize_mxfp4(stacked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' stacked experts [E, in, out] -> (blocks uint8 [E, out, in / 32, 16], scales
    uint8 [E, out, in / 32]): each group of 32 inputs of an output row gets the exponent that
    brings its largest magnitude to at most 6 (stored plus 127), each value the nearest e2m1
    code, two codes a byte, the even element in the low nibble."""
    rows = stacked.transpose(1, 2).float()  # [E, out, in]
    groups = rows.reshape(*rows.shape[:-1], -1, GROUP)  # [E, out, G, 32]
    largest = groups.abs().amax(dim=-1, keepdim=True).clamp(min=2.0**-100)
    exponent = torch.ceil(torch.log2(largest / 6.0))
    codes = ((groups / torch.exp2(exponent)).unsqueeze(-1) - E2M1).abs().argmin(dim=-1).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # [E, out, G, 16]
    return blocks, (exponent.squeeze(-1) + 127).to(torch.uint8)


def test_mxfp4_experts_compute_what_transformers_converts(tmp_path):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf_model = make_gpt_oss_checkpoint(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(tensors.pop(name))
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        # the reference's experts: transformers' own dequantization of the same bytes
        module, param = name.rsplit(".", 1)
        dense = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        getattr(hf_model.get_submodule(module), param).data.copy_(dense)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (tmp_path / "config.json").write_text(json.dumps(config))

    llm = LLM(str(tmp_path), plugins=["gpt_oss", "cpu"], dtype="float32", kv_cache_memory=0.05, progress=False)
    # kept in their values: no dense stack, each expert's projections group-quantized (6-bit
    # values, a zero of 12), nothing dequantized
    layers = len(llm.engine.model.model.layers)
    assert llm.engine.dequantizer.kept == 2 * layers and llm.engine.dequantizer.dequantized == 0
    for layer in llm.engine.model.model.layers:
        experts = layer.mlp.experts
        assert not hasattr(experts, "gate_up_proj") and not hasattr(experts, "down_proj")
        assert all(w.zero == 12 for proj in ("gate_up_proj", "down_proj") for w in experts.quantized[proj])
    prompts = random_prompts(3, (7, 30))
    for prompt, logits in zip(prompts, llm.prompt_logits(prompts)):
        with torch.no_grad():
            reference = hf_model(torch.tensor([prompt])).logits[0]
        error = (logits - reference).abs().max().item()
        assert error <= 1e-4 * max(1.0, reference.abs().max().item()), f"{len(prompt)} tokens: {error:.3g}"


def test_mxfp4_blocks_that_do_not_fit_are_refused_by_name(tmp_path):
    import pytest

    make_gpt_oss_checkpoint(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(tensors.pop(name))
        if ".0.mlp.experts.down_proj" in name:
            blocks = blocks[:, :-1]  # one output row short
        tensors[name + "_blocks"], tensors[name + "_scales"] = (
            blocks.contiguous(),
            scales[:, : blocks.shape[1]].contiguous(),
        )
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.experts\.down_proj_blocks: MXFP4 blocks"):
        LLM(str(tmp_path), plugins=["gpt_oss", "cpu"], dtype="float32", kv_cache_memory=0.05, progress=False)
