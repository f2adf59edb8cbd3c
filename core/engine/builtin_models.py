"""Built-in checkpoints, so that nothing has to be downloaded.

``demo`` is a small trained Llama chat model shipped inside the package
(``engine/demo_model``, rebuilt by ``tools/train_demo_model.py``): the default
of ``engine serve``, so a fresh install answers in English.

``llama58m`` is the benchmark model of the project's workloads: random weights
from ``torch.manual_seed(0)`` and a fixed ``LlamaConfig``, saved as safetensors
under the engine cache directory (``ENGINE_CACHE_DIR``, default
``~/.cache/engine``) the first time it is asked for.

``qwen3.5-61m`` is its hybrid counterpart for benchmarks of models with recurrent
layers: a Qwen3.5 of the same width, depth, heads and vocabulary whose layers are gated
DeltaNet three to one gated attention, made the same way (served by engine-qwen).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger("engine")

LLAMA58M_CONFIG = dict(
    hidden_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=8,
    intermediate_size=1408,
    vocab_size=32000,
    max_position_embeddings=4096,
)

# Qwen3.5 at llama58m's size: six gated DeltaNet layers (8 key and 8 value heads of 64), two of
# gated attention (8 heads of 64)
QWEN35_61M_CONFIG = dict(
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=8,
    head_dim=64,
    linear_num_key_heads=8,
    linear_num_value_heads=8,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
    vocab_size=32000,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)

BUILTIN_MODELS = {
    "demo": "Llama, a few million parameters trained on Python docstrings, with a chat template; the server's default.",
    "llama58m": "Llama, 58.5M parameters, random weights (seed 0); the benchmark model.",
    "qwen3.5-61m": "Qwen3.5 (gated DeltaNet and gated attention), 60.7M parameters, random weights (seed 0); "
    "the hybrid benchmark model (needs engine-qwen).",
}
DEMO_MODEL_DIR = Path(__file__).parent / "demo_model"


def cache_dir() -> Path:
    return Path(os.environ.get("ENGINE_CACHE_DIR", Path.home() / ".cache" / "engine"))


def ensure(name: str) -> Path:
    """Return the directory of built-in model ``name``, creating it if missing."""
    if name not in BUILTIN_MODELS:
        raise KeyError(f"Unknown built-in model {name!r}. Available: {', '.join(BUILTIN_MODELS)}.")
    if name == "demo":
        if not (DEMO_MODEL_DIR / "config.json").is_file():
            raise FileNotFoundError(
                f"The demo model's files are missing from {DEMO_MODEL_DIR}; reinstall engine, or rebuild them with "
                f"'python tools/train_demo_model.py --out {DEMO_MODEL_DIR}'."
            )
        return DEMO_MODEL_DIR
    target = cache_dir() / "models" / name
    if (target / "config.json").is_file():
        return target
    logger.info("Creating built-in model %s in %s", name, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        _MAKERS[name](tmp)
        if target.exists():  # created concurrently by another process
            shutil.rmtree(tmp)
        else:
            tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _make_llama58m(path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA58M_CONFIG))
    model.save_pretrained(path)


def _make_qwen35_61m(path: Path) -> None:
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**QWEN35_61M_CONFIG))
    model.save_pretrained(path)


_MAKERS = {"llama58m": _make_llama58m, "qwen3.5-61m": _make_qwen35_61m}
