"""Checks for quantizers that hold mixture-of-experts layers quantized
(``Quantizer.get_experts_method``), on a tiny Qwen3-MoE whose routed experts are written per
expert in the format (``mlp.experts.<e>.<proj>.<tensor>``, as GPTQModel, AutoAWQ and
llm-compressor write them): the engine's logits against the same model with every quantized
weight dequantized by the plugin's own reference (the format's spec written plainly), loaded
unquantized; quantizing while loading against the prequantized checkpoint; and the errors
for quantized experts without a method and for a missing projection."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NUM_EXPERTS = 4
MOE_CONFIG = dict(
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


@dataclass(frozen=True)
class MoECheckpoints:
    base: Path  # bf16, experts as transformers saves them
    quantized: Path  # every linear module and expert projection in the format
    dequantized: Path  # the quantized weights dequantized by the reference, unquantized


def per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stacked expert tensors (transformers 5: ``experts.gate_up_proj`` [E, 2I, hidden],
    ``experts.down_proj`` [E, hidden, I]) as per-expert ``experts.<e>.<proj>.weight``."""
    out = {}
    for name, tensor in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            prefix = name[: -len("gate_up_proj")]
            for e in range(tensor.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"], out[f"{prefix}{e}.up_proj.weight"] = gate[e], up[e]
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(tensor.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = tensor[e]
        else:
            out[name] = tensor
    return out


def save(path: Path, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors", {"format": "pt"})


def moe_checkpoints(
    root: Path,
    quantization_config: dict,
    export: Callable[[torch.Tensor], dict[str, torch.Tensor]],
    dequantize: Callable[[dict[str, torch.Tensor]], torch.Tensor],
) -> MoECheckpoints:
    """Write the three checkpoints under ``root``: ``export(weight)`` gives one module's tensors
    in the format, ``dequantize(tensors)`` the reference's dense weight [out, in] from them."""
    from safetensors.torch import load_file
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**MOE_CONFIG)).to(torch.bfloat16).eval()
    model.save_pretrained(root / "base")
    config = json.loads((root / "base" / "config.json").read_text())
    state = per_expert(load_file(root / "base" / "model.safetensors"))
    quantized, dequantized = {}, {}
    for name, tensor in state.items():
        module = name.removesuffix(".weight")
        if not name.endswith(".weight") or module.split(".")[-1] not in LINEAR:
            quantized[name] = dequantized[name] = tensor
            continue
        tensors = export(tensor)
        quantized.update({f"{module}.{key}": value for key, value in tensors.items()})
        dequantized[name] = dequantize(tensors).float()
    save(root / "quantized", {**config, "quantization_config": quantization_config}, quantized)
    save(root / "dequantized", config, dequantized)
    return MoECheckpoints(root / "base", root / "quantized", root / "dequantized")


def _llm(path: Path, plugins: list[str], dtype: str, **kwargs):
    from engine import LLM

    return LLM(str(path), plugins=plugins, dtype=dtype, progress=False, kv_cache_memory=0.05, **kwargs)


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 320) for _ in range(n)] for n in (4, 13, 30)]


def check_experts_match_dequantized(
    checkpoints: MoECheckpoints, plugins: list[str], dtype: str, tolerance: float, held_fraction: float = 0.5
):
    """The quantized checkpoint holds its experts as its method's weights (the group-quantized
    layout, or FP8 bytes with their factors), under ``held_fraction`` of their bf16 bytes, and
    its logits are within ``tolerance`` (relative to the largest logit) of the dequantized
    model's."""
    from engine.interfaces.fp8 import Fp8Weight
    from engine.interfaces.group_quant import GroupQuantWeight

    llm = _llm(checkpoints.quantized, plugins, dtype)
    experts = llm.engine.model.model.layers[0].mlp.experts
    assert not hasattr(experts, "w13") and not hasattr(experts, "w2"), "the experts keep a dense copy"
    assert len(experts.down) == NUM_EXPERTS
    assert all(isinstance(w, (GroupQuantWeight, Fp8Weight)) for w in experts.down)
    held = sum(p.numel() * p.element_size() for p in experts.parameters())
    dense = NUM_EXPERTS * 3 * MOE_CONFIG["moe_intermediate_size"] * MOE_CONFIG["hidden_size"] * 2
    assert held < held_fraction * dense, f"quantized experts hold {held} bytes, the bf16 ones {dense}"
    batch = _prompts(0)
    for got, want in zip(llm.prompt_logits(batch), _llm(checkpoints.dequantized, plugins, dtype).prompt_logits(batch)):
        error = (got.float() - want.float()).abs().max().item() / want.float().abs().max().item()
        assert error <= tolerance, f"{dtype}: relative logit difference {error:.2e}"
    return llm


def check_quantizing_while_loading_matches(
    checkpoints: MoECheckpoints, plugins: list[str], quantization: str, settings: dict, dtype: str = "float32"
) -> None:
    """``--quantization`` on the bf16 checkpoint (stacked experts) holds the very tensors the
    prequantized checkpoint's per-expert modules give, and the same logits, in ``dtype`` (the
    model's, for formats whose scales take it)."""
    on_the_fly = _llm(checkpoints.base, plugins, dtype, quantization=quantization, quantization_config=settings)
    prequantized = _llm(checkpoints.quantized, plugins, dtype)
    from engine.interfaces.fp8 import FP8_HELD_TENSORS
    from engine.interfaces.group_quant import HELD_TENSORS

    def held(llm) -> dict[str, torch.Tensor]:  # the quantized weights' tensors
        params = llm.engine.model.named_parameters()
        names = HELD_TENSORS + FP8_HELD_TENSORS
        return {name: p for name, p in params if name.rpartition(".")[2].startswith(names)}

    a, b = held(on_the_fly), held(prequantized)
    assert sorted(a) == sorted(b) and any(".experts." in name for name in a)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    batch = _prompts(1)
    for x, y in zip(on_the_fly.prompt_logits(batch), prequantized.prompt_logits(batch)):
        assert torch.equal(x, y)


def check_load_errors(checkpoints: MoECheckpoints, plugins: list[str], tmp_path: Path) -> None:
    """Quantized expert tensors with no quantization_config are refused by name; so is a
    checkpoint that leaves out one expert projection."""
    from safetensors.torch import load_file

    config = json.loads((checkpoints.quantized / "config.json").read_text())
    tensors = load_file(checkpoints.quantized / "model.safetensors")
    plain = {k: v for k, v in tensors.items() if ".experts." in k or "_proj." not in k}
    save(tmp_path / "plain", {k: v for k, v in config.items() if k != "quantization_config"}, plain)
    with pytest.raises(ValueError, match=r"Expert \d+ \w+_proj\.\w+: a quantized expert tensor"):
        _llm(tmp_path / "plain", plugins, "float32")
    short = {k: v for k, v in tensors.items() if ".mlp.experts.2.up_proj." not in k}
    save(tmp_path / "short", config, short)
    with pytest.raises(ValueError, match=r"expert projections: model\.layers\.0\.mlp\.experts\.2\.up_proj"):
        _llm(tmp_path / "short", plugins, "float32")


class QuantizedExpertsTests:
    """The checks above as a test class: subclass with ``plugins``, ``quantization`` (the
    ``--quantization`` name), ``quantization_config`` (the checkpoint's), ``export(weight)`` (one
    module's tensors in the format) and ``dequantize(tensors)`` (the format's reference);
    ``on_the_fly_dtype`` is the dtype quantizing while loading is compared in (the model's, for
    formats whose scales take it); ``held_fraction`` bounds the experts' bytes against bf16's."""

    plugins: list[str]
    quantization: str
    quantization_config: dict
    on_the_fly_dtype = "float32"
    held_fraction = 0.5
    # fp32: the order of the float32 sums; bf16: the dense reference rounds its weights to bf16,
    # and the routed experts carry it on (measured up to 3.2e-2)
    tolerance = {"float32": 1e-4, "bfloat16": 5e-2}

    @classmethod
    def export(cls, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    @classmethod
    def dequantize(cls, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    @pytest.fixture(scope="class")
    @classmethod
    def checkpoints(cls, tmp_path_factory: pytest.TempPathFactory) -> MoECheckpoints:
        return moe_checkpoints(tmp_path_factory.mktemp("moe"), cls.quantization_config, cls.export, cls.dequantize)

    def test_experts_run_from_their_packed_weights_in_float32(self, checkpoints) -> None:
        check_experts_match_dequantized(
            checkpoints, self.plugins, "float32", self.tolerance["float32"], self.held_fraction
        )

    def test_experts_run_from_their_packed_weights_in_bfloat16(self, checkpoints) -> None:
        check_experts_match_dequantized(
            checkpoints, self.plugins, "bfloat16", self.tolerance["bfloat16"], self.held_fraction
        )

    def test_quantizing_experts_while_loading_matches_the_checkpoint(self, checkpoints) -> None:
        check_quantizing_while_loading_matches(
            checkpoints, self.plugins, self.quantization, self.quantization_config, self.on_the_fly_dtype
        )

    def test_quantized_experts_without_a_method_or_a_projection_are_refused_by_name(
        self, checkpoints, tmp_path
    ) -> None:
        check_load_errors(checkpoints, self.plugins, tmp_path)
