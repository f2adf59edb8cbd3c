"""The checkpoint a bench runs (``--checkpoint``: a directory of safetensors, quantized or
not, or a GGUF file), and which peers can run the same weights.

The engine runs whatever it loads. hf and vllm read safetensors directories (a quantized
one only if their own install has its kernels: they are tried, and a failure is reported
in the peer's row); llama.cpp runs a GGUF file as it is and a dense directory through a
GGUF of the same weights the bench writes (``gguf_export.py``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GGUF_SUFFIX = ".gguf"


@dataclass(frozen=True)
class BenchCheckpoint:
    path: Path
    vocab_size: int
    is_gguf: bool
    quant_method: str | None  # the directory's quantization_config.quant_method; "gguf" for a GGUF file
    quantization_config: dict[str, Any] | None

    @classmethod
    def resolve(cls, model: str) -> BenchCheckpoint:
        """``model``: a GGUF file, a checkpoint directory, a built-in model name or a Hub id."""
        path = Path(model).expanduser()
        if path.suffix == GGUF_SUFFIX:
            if not path.is_file():
                raise FileNotFoundError(f"--checkpoint {model}: no such GGUF file.")
            return cls(path, gguf_vocab_size(path), True, "gguf", None)
        from engine.model_loader.checkpoint import resolve_model_path

        path = resolve_model_path(model)
        with open(path / "config.json", encoding="utf-8") as f:
            config = json.load(f)
        text_config = config.get("text_config") or {}
        quantization = config.get("quantization_config")
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        vocab_size = int(config.get("vocab_size") or text_config.get("vocab_size") or 0)
        return cls(path, vocab_size, False, method, quantization)

    @property
    def is_quantized(self) -> bool:
        return self.quant_method is not None

    def describe(self) -> str:
        if self.is_gguf:
            return f"GGUF file ({', '.join(gguf_tensor_types(self.path))})"
        if self.quantization_config is None:
            return "safetensors"
        settings = ", ".join(f"{k} {v}" for k, v in self.quantization_config.items() if k != "quant_method")
        return f"safetensors quantized with {self.quant_method}{f' ({settings})' if settings else ''}"

    def peer_refusal(self, peer: str) -> str | None:
        """Why ``peer`` cannot run this checkpoint, or None when it may try."""
        if self.is_gguf and peer in ("hf", "vllm"):
            return f"runs safetensors checkpoint directories; {self.path.name} is a GGUF file"
        if peer == "llamacpp" and self.is_quantized and not self.is_gguf:
            return (
                f"runs GGUF files, and the bench writes a GGUF of dense weights only; this checkpoint is "
                f"quantized with {self.quant_method} (give --checkpoint a .gguf file to run llama.cpp on one)"
            )
        return None


def _gguf_reader(path: Path) -> Any:
    """The file's reader, from the parse the engine's loader shares (``open_gguf``)."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise RuntimeError(
            f"Reading the GGUF file {path} needs the gguf package: pip install gguf (in engine's test extras)."
        ) from None
    from engine.model_loader.gguf import open_gguf

    return open_gguf(path).reader


def gguf_vocab_size(path: Path) -> int:
    """The vocabulary of a GGUF file: ``<arch>.vocab_size``, else its token list, else the rows
    of its embedding table."""
    reader = _gguf_reader(path)

    def field(name: str) -> Any:
        found = reader.get_field(name)
        return None if found is None else found.contents()

    architecture = field("general.architecture")
    size = field(f"{architecture}.vocab_size") if architecture else None
    if size is None:
        tokens = field("tokenizer.ggml.tokens")
        size = len(tokens) if tokens else None
    if size is None:
        table = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
        size = int(table.shape[-1]) if table is not None else None  # GGUF lists dims innermost first
    if not size:
        raise ValueError(f"{path} says nothing of its vocabulary (no vocab_size, token list or token_embd.weight).")
    return int(size)


def gguf_tensor_types(path: Path) -> list[str]:
    """The GGUF file's tensor types with their counts, most common first: ``Q4_K x 140``."""
    counts: dict[str, int] = {}
    for tensor in _gguf_reader(path).tensors:
        counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
    return [f"{name} x {n}" for name, n in sorted(counts.items(), key=lambda item: -item[1])]
