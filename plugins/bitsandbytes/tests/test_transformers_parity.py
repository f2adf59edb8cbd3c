"""engine-bitsandbytes against transformers' bitsandbytes models on the same checkpoints:
tiny Llamas quantized by transformers with ``BitsAndBytesConfig`` and saved with
``save_pretrained``, the layout the plugin must load.

Both sides compute in float32 around the quantized layers (in bfloat16 the two
implementations' own rounding differs by about 1% of the logits, quantized or not).
transformers' ``Linear4bit`` on a CPU with AVX512-BF16 repacks the weight for
bitsandbytes' CPU GEMV kernel, which sums in another order than ``matmul_4bit`` on
the stored layout that the engine calls: the logits are compared with both, the
first to a tight tolerance, the second to a looser one.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.testing.checkpoints import make_tiny_checkpoint

# label -> (BitsAndBytesConfig arguments, tiny-config overrides)
QUANTIZED_CASES = {
    "nf4-double-bf16": (
        {
            "load_in_4bit": True,
            "bnb_4bit_quant_type": "nf4",
            "bnb_4bit_use_double_quant": True,
            "bnb_4bit_compute_dtype": torch.bfloat16,
        },
        {},
    ),
    "nf4-fp32-compute-bias": (
        {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
        {"attention_bias": True, "mlp_bias": True},
    ),
    "fp4": ({"load_in_4bit": True, "bnb_4bit_quant_type": "fp4", "bnb_4bit_compute_dtype": torch.bfloat16}, {}),
    "fp4-double": (
        {
            "load_in_4bit": True,
            "bnb_4bit_quant_type": "fp4",
            "bnb_4bit_use_double_quant": True,
            "bnb_4bit_compute_dtype": torch.bfloat16,
        },
        {},
    ),
    "int8": ({"load_in_8bit": True}, {}),
    "int8-skip-o_proj": (
        {"load_in_8bit": True, "llm_int8_skip_modules": ["o_proj", "lm_head"]},
        {"attention_bias": True},
    ),
}


@pytest.fixture(scope="module")
def quantized_checkpoint(tmp_path_factory):
    """``quantized_checkpoint(label) -> (unquantized checkpoint dir, quantized checkpoint dir)``."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    made = {}

    def make(label: str):
        if label not in made:
            arguments, overrides = QUANTIZED_CASES[label]
            root = tmp_path_factory.mktemp(label)
            make_tiny_checkpoint(
                "LlamaForCausalLM",
                root / "base",
                dtype="bfloat16",
                initializer_range=0.1,
                **{"hidden_size": 128, "intermediate_size": 256, **overrides},
            )
            model = AutoModelForCausalLM.from_pretrained(
                root / "base",
                quantization_config=BitsAndBytesConfig(**arguments),
                dtype=torch.bfloat16,
                device_map="cpu",
            )
            model.save_pretrained(root / "quantized")
            made[label] = (root / "base", root / "quantized")
        return made[label]

    return make


PLUGINS = ["cpu", "llama", "bitsandbytes"]
PROMPT_LENGTHS = [3, 6, 11, 17, 25, 32]
# largest |engine − transformers| over the logits, relative to the largest |logit|: against
# transformers running matmul_4bit as the engine does (each quantized layer agrees bit for
# bit; float32 rounding differences elsewhere, about 1e-7, can flip the rounding of an
# activation to a bfloat16 compute dtype, measured up to 0.55% of the logits), and against
# its repacked CPU kernel
TOLERANCE = 1e-2
TOLERANCE_REPACKED = 3e-2


def make_prompts(vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]


def make_llm(path, dtype: str = "float32", **kwargs) -> LLM:
    return LLM(str(path), plugins=PLUGINS, dtype=dtype, progress=False, kv_cache_memory=0.05, **kwargs)


def transformers_float32(path, *, repacked: bool):
    """transformers' model of the quantized checkpoint with everything it leaves unquantized
    in float32, as the engine computes with dtype float32 (loading a quantized checkpoint,
    transformers keeps those parameters in the checkpoint's bfloat16)."""
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, device_map="cpu").eval()
    for module in model.modules():
        quantized = isinstance(module, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))
        if isinstance(module, bnb.nn.Linear4bit) and not repacked:
            module.support_avx512bf16_for_cpu = False  # keep the stored layout: matmul_4bit
        for name, param in module.named_parameters(recurse=False):
            if not (quantized and name == "weight"):
                param.data = param.data.float()
    return model


def one_at_a_time(label: str) -> bool:
    """LLM.int8 picks its outlier columns over all the tokens of a batch, so its output
    depends on what else is in the batch: compare it on one request at a time."""
    arguments = QUANTIZED_CASES[label][0]
    return bool(arguments.get("load_in_8bit")) and arguments.get("llm_int8_threshold", 6.0) > 0


def engine_logits(llm: LLM, prompts: list[list[int]], label: str) -> list[torch.Tensor]:
    if one_at_a_time(label):
        return [llm.prompt_logits([prompt])[0] for prompt in prompts]
    return llm.prompt_logits(prompts)


@pytest.mark.parametrize("label", sorted(QUANTIZED_CASES))
@pytest.mark.parametrize("repacked", [False, True], ids=["matmul_4bit", "repacked"])
def test_prompt_logits_match_transformers(quantized_checkpoint, label, repacked):
    _, path = quantized_checkpoint(label)
    reference_model = transformers_float32(path, repacked=repacked)
    prompts = make_prompts(reference_model.config.vocab_size, seed=0)
    for prompt, logits in zip(prompts, engine_logits(make_llm(path), prompts, label)):
        with torch.no_grad():
            reference = reference_model(torch.tensor([prompt])).logits[0].float()
        error = (logits.float() - reference).abs().max().item() / reference.abs().max().item()
        assert error <= (TOLERANCE_REPACKED if repacked else TOLERANCE), (
            f"{label}: relative logit difference {error:.5f}"
        )


@pytest.mark.parametrize("label", sorted(QUANTIZED_CASES))
def test_greedy_tokens_match_transformers(quantized_checkpoint, label):
    _, path = quantized_checkpoint(label)
    reference_model = transformers_float32(path, repacked=False)
    llm = make_llm(path, **({"max_num_seqs": 1} if one_at_a_time(label) else {}))
    prompts = make_prompts(reference_model.config.vocab_size, seed=1)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        with torch.no_grad():
            expected = reference_model.generate(
                torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False
            )[0, len(prompt) :].tolist()
        assert output.outputs[0].token_ids == expected


@pytest.mark.parametrize("label", sorted(QUANTIZED_CASES))
def test_quantizing_while_loading_matches_the_prequantized_checkpoint(quantized_checkpoint, label):
    """--quantization bitsandbytes with the checkpoint's settings on the unquantized weights
    gives bit-identical logits to loading what transformers quantized and saved."""
    base, path = quantized_checkpoint(label)
    settings = json.loads((path / "config.json").read_text())["quantization_config"]
    settings.pop("quant_method")
    on_the_fly = make_llm(base, "bfloat16", quantization="bitsandbytes", quantization_config=settings)
    prequantized = make_llm(path, "bfloat16")
    prompts = make_prompts(256, seed=2)
    for a, b in zip(on_the_fly.prompt_logits(prompts), prequantized.prompt_logits(prompts)):
        assert torch.equal(a, b)


def test_declined_layers_stay_in_the_checkpoint_dtype(quantized_checkpoint):
    _, path = quantized_checkpoint("int8-skip-o_proj")
    model = make_llm(path, "bfloat16").engine.model
    attention = model.model.layers[0].self_attn
    assert attention.o_proj.weight.dtype == torch.bfloat16 and model.lm_head.weight.dtype == torch.bfloat16
    assert attention.qkv_proj.weight.dtype == torch.int8 and attention.qkv_proj.SCB.dtype == torch.float32
