"""Locating a checkpoint: a local directory, a GGUF file, a built-in model, or a Hub repository."""

from __future__ import annotations

import json
import os
from pathlib import Path

WEIGHT_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.txt", "*.jinja"]
GGUF_SUFFIX = ".gguf"


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` is a GGUF checkpoint file (:mod:`engine.model_loader.gguf`)."""
    path = Path(path)
    return path.suffix == GGUF_SUFFIX and path.is_file()


def gguf_in_directory(path: Path) -> Path | None:
    """The one ``.gguf`` file of a directory without config.json (None when it has none); a
    FileNotFoundError when it has several."""
    files = sorted(path.glob(f"*{GGUF_SUFFIX}"))
    if len(files) > 1:
        raise FileNotFoundError(
            f"Model directory {str(path)!r} has no config.json and several GGUF files "
            f"({', '.join(f.name for f in files)}): pass the path of the one to load."
        )
    return files[0] if files else None


def resolve_model_path(model: str) -> Path:
    """Return a local directory holding ``config.json`` for ``model``, or a ``.gguf`` file.

    ``model`` is a directory, a ``.gguf`` file (or a directory holding one and no
    config.json, see :mod:`engine.model_loader.gguf`), the name of a built-in model (see
    :mod:`engine.builtin_models`), or a Hugging Face Hub repository id, fetched
    (safetensors and config files only) into the local Hub cache.
    """
    path = Path(model).expanduser()
    if is_gguf(path):
        return path
    if path.is_dir():
        if not (path / "config.json").is_file():
            found = gguf_in_directory(path)
            if found is not None:
                return found
            raise FileNotFoundError(f"Model directory {str(path)!r} has no config.json (nor a .gguf file).")
        return path
    from engine import builtin_models

    if model in builtin_models.BUILTIN_MODELS:
        return builtin_models.ensure(model)
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise FileNotFoundError(
            f"Model {model!r} is not a checkpoint directory, a built-in model "
            f"({', '.join(builtin_models.BUILTIN_MODELS)}) or a Hub repository id (owner/name)."
        )
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, allow_patterns=WEIGHT_PATTERNS))
    except Exception as exc:
        offline = (
            " (HF_HUB_OFFLINE is set, so only the local Hub cache was searched)"
            if os.environ.get("HF_HUB_OFFLINE")
            else ""
        )
        raise FileNotFoundError(f"Could not fetch model {model!r} from the Hub{offline}: {exc}") from exc


def read_config(model_path: Path) -> dict:
    """The checkpoint's ``config.json``; a GGUF file's made from its metadata."""
    if is_gguf(model_path):
        from engine.model_loader.gguf import gguf_config

        return gguf_config(model_path)
    with open(model_path / "config.json", encoding="utf-8") as f:
        return json.load(f)


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors files: from the shard index when there is one (a GGUF
    checkpoint's one file: :func:`engine.model_loader.weights.iterate_weights` reads both)."""
    if is_gguf(model_dir):
        return [model_dir]
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"Shards listed in {index.name} are missing: {', '.join(missing)}.")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in model_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        hint = (
            f" Found {', '.join(others)}: pickle checkpoints are not loaded; convert them to safetensors."
            if others
            else ""
        )
        raise FileNotFoundError(f"No .safetensors files in {str(model_dir)!r}.{hint}")
    return files


def checkpoint_dtype(config: dict) -> str | None:
    value = config.get("dtype") or config.get("torch_dtype")
    return value if isinstance(value, str) else None


def eos_token_ids(model_dir: Path, config: dict) -> frozenset[int]:
    """EOS ids from generation_config.json, else config.json."""
    value = None
    generation = model_dir / "generation_config.json"
    if generation.is_file():
        with open(generation, encoding="utf-8") as f:
            value = json.load(f).get("eos_token_id")
    if value is None:
        value = config.get("eos_token_id")
    if value is None:
        return frozenset()
    return frozenset(value if isinstance(value, list) else [value])


# generation_config.json fields that serve as a server's sampling defaults (vLLM's "auto" generation config)
SAMPLING_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(model_dir: Path) -> dict[str, float | int]:
    """The checkpoint's recommended sampling settings, from generation_config.json: used for
    the fields a request leaves out. Empty when the file is absent or sets none of them."""
    generation = model_dir / "generation_config.json"
    if not generation.is_file():
        return {}
    with open(generation, encoding="utf-8") as f:
        values = json.load(f)
    return {name: values[name] for name in SAMPLING_DEFAULT_FIELDS if isinstance(values.get(name), (int, float))}
