"""Loading the checkpoint's Hugging Face tokenizer, when it has one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer(path: str | Path) -> Any | None:
    """``transformers.AutoTokenizer`` for ``path``, or None when it holds no tokenizer files; for
    a ``.gguf`` file, the tokenizer its metadata describes (built by transformers)."""
    path = Path(path)
    if path.suffix == ".gguf" and path.is_file():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
