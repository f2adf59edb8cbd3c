"""Built-in checkpoints, so that nothing has to be downloaded.

``demo`` is a small trained Llama chat model shipped inside the package
(``engine/demo_model``, rebuilt by ``tools/train_demo_model.py``): the default
of ``engine serve``, so a fresh install answers in English.

``llama58m`` is the benchmark model of the project's workloads: random weights
from ``torch.manual_seed(0)`` and a fixed ``LlamaConfig``, saved as safetensors
under the engine cache directory (``ENGINE_CACHE_DIR``, default
``~/.cache/engine``) the first time it is asked for.
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

BUILTIN_MODELS = {
    "demo": "Llama, a few million parameters trained on Python docstrings, with a chat template; the server's default.",
    "llama58m": "Llama, 58.5M parameters, random weights (seed 0); the benchmark model.",
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
        _make_llama58m(tmp)
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
