"""Loading the checkpoint's Hugging Face tokenizer, when it has one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer(path: str | Path) -> Any | None:
    """``transformers.AutoTokenizer`` for ``path``, or None when it holds no tokenizer files."""
    path = Path(path)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
