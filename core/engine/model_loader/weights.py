"""Streaming safetensors tensors (memory-mapped) into a model, with a progress bar."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from engine.interfaces.model import Model


def iterate_weights(files: list[Path], *, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor in ``files``, one at a time."""
    handles = [safe_open(str(path), framework="pt", device="cpu") for path in files]
    total = sum(len(handle.keys()) for handle in handles)
    with tqdm(total=total, desc="Loading weights", unit="tensor", disable=not progress, leave=False) as bar:
        for handle in handles:
            for name in handle.keys():
                yield name, handle.get_tensor(name)
                bar.update(1)


def load_weights(model: Model, files: list[Path], *, progress: bool = True) -> None:
    """Fill every parameter of ``model`` from ``files``; raise naming what is missing."""
    loaded = model.load_weights(iterate_weights(files, progress=progress))
    expected = {name for name, _ in model.named_parameters()}
    missing = sorted(expected - loaded)
    if missing:
        shown = ", ".join(missing[:10]) + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
        raise ValueError(f"The checkpoint did not provide these parameters: {shown}.")
