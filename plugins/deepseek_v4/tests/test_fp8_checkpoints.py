"""DeepSeek checkpoints published in FP8 (and V4's FP4 experts) load on a platform without FP8
kernels: the weights are dequantized while loading, and the logits are transformers' on the
same model with the dequantized weights put in directly."""

from __future__ import annotations

import json
import random

import pytest
import torch
from deepseek_helpers import make_llm
from safetensors.torch import load_file, save_file

BLOCK = (16, 16)
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def fp8_quantize(weight: torch.Tensor, power_of_two: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, scales per 16 x 16 block, the dense weight they stand for)."""
    rows, cols = weight.shape
    scales = torch.empty(-(-rows // BLOCK[0]), -(-cols // BLOCK[1]))
    quantized = torch.empty(weight.shape, dtype=torch.float8_e4m3fn)
    dense = torch.empty(weight.shape)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            part = (slice(i * BLOCK[0], (i + 1) * BLOCK[0]), slice(j * BLOCK[1], (j + 1) * BLOCK[1]))
            scale = float(weight[part].abs().max()) / 448
            if power_of_two:
                scale = 2.0 ** torch.tensor(scale).log2().ceil().item()
            scales[i, j] = scale
            quantized[part] = (weight[part] / scale).to(torch.float8_e4m3fn)
            dense[part] = quantized[part].float() * scale
    return quantized, scales, dense


def fp4_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed int8 [rows, cols / 2], e8m0 scales [rows, cols / 32], the dense weight): per 32 values
    of a row a power of two, each value the nearest e2m1 of value / scale."""
    rows, cols = weight.shape
    groups = weight.view(rows, cols // 32, 32)
    exponents = (groups.abs().amax(dim=-1) / 6).clamp(min=2.0**-100).log2().ceil()  # [rows, cols / 32]
    scaled = groups / 2.0 ** exponents[..., None]
    magnitude = (scaled.abs()[..., None] - E2M1).abs().argmin(dim=-1)  # nearest of the eight magnitudes
    codes = (magnitude + 8 * (scaled < 0)).view(rows, cols)
    dense = (E2M1[magnitude] * scaled.sign() * 2.0 ** exponents[..., None]).view(rows, cols)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    scales = (exponents + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
    return packed, scales, dense


def quantize_checkpoint(path, reference_path, quantized: str, scale_suffix: str, fp4: str | None = None):
    """Rewrite the checkpoint at ``path``: 2-D weights whose names match ``quantized`` in FP8 (with
    ``scale_suffix`` scales; e8m0 powers of two for ".scale"), those matching ``fp4`` in MXFP4,
    the scales in a second shard. Returns transformers' model loaded from a dense copy (at
    ``reference_path``) holding the weights the quantized ones stand for."""
    import re
    import shutil

    import transformers

    tensors = load_file(str(path / "model.safetensors"))
    shutil.copytree(path, reference_path)
    weights, scales, dense = {}, {}, dict(tensors)
    for name, tensor in tensors.items():
        if fp4 and re.search(fp4, name):
            weights[name], scales[name.removesuffix(".weight") + ".scale"], dense[name] = fp4_quantize(tensor)
        elif re.search(quantized, name) and tensor.dim() == 2:
            e8m0 = scale_suffix == ".scale"
            weights[name], scale, dense[name] = fp8_quantize(tensor, power_of_two=e8m0)
            scales[name.removesuffix(".weight") + scale_suffix] = scale.to(torch.float8_e8m0fnu) if e8m0 else scale
        else:
            weights[name] = tensor
    (path / "model.safetensors").unlink()
    save_file(weights, str(path / "model-00001-of-00002.safetensors"))
    save_file(scales, str(path / "model-00002-of-00002.safetensors"))
    weight_map = {n: "model-00001-of-00002.safetensors" for n in weights}
    weight_map.update({n: "model-00002-of-00002.safetensors" for n in scales})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(BLOCK),
    }
    (path / "config.json").write_text(json.dumps(config))
    save_file(dense, str(reference_path / "model.safetensors"))
    architecture = config["architectures"][0]
    return getattr(transformers, architecture).from_pretrained(reference_path, dtype=torch.float32).eval()


@pytest.mark.parametrize(
    "architecture, quantized, suffix, fp4",
    [
        pytest.param("DeepseekV3ForCausalLM", r"(proj|proj_with_mqa)\.weight$", ".weight_scale_inv", None, id="v3"),
        pytest.param(
            "DeepseekV4ForCausalLM",
            r"\.attn\.(wq_a|wq_b|wkv|wo_b)\.weight$|shared_experts",
            ".scale",
            r"\.experts\.\d+\.w[123]\.weight$",
            id="v4-fp4-experts",
        ),
    ],
)
def test_fp8_checkpoints_load_dequantized_and_match_transformers(tmp_path, architecture, quantized, suffix, fp4):
    from engine.testing.checkpoints import make_tiny_checkpoint

    path = tmp_path / "fp8"
    make_tiny_checkpoint(architecture, path)
    hf_model = quantize_checkpoint(path, tmp_path / "dense", quantized, suffix, fp4)
    rng = random.Random(0)
    batch = [[rng.randrange(3, 320) for _ in range(n)] for n in (5, 19, 33)]
    llm = make_llm(path)
    assert llm.engine.dequantizer is not None and llm.engine.dequantizer.dequantized > 10
    for prompt, logits in zip(batch, llm.prompt_logits(batch)):
        with torch.no_grad():
            reference = hf_model(torch.tensor([prompt])).logits[0]
        assert (logits - reference).abs().max().item() <= 1e-4 * max(1.0, reference.abs().max().item())
