"""Streaming safetensors tensors (memory-mapped) into a model, with a progress bar."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from engine.interfaces.model import Model
from engine.layers.linear import linear_layers, tied_linear_layers
from engine.model_loader.dequant import CheckpointDequantizer, dequantize_stream


def iterate_weights(files: list[Path], *, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor in ``files``, one at a time."""
    handles = [safe_open(str(path), framework="pt", device="cpu") for path in files]
    total = sum(len(handle.keys()) for handle in handles)
    with tqdm(total=total, desc="Loading weights", unit="tensor", disable=not progress, leave=False) as bar:
        for handle in handles:
            for name in handle.keys():
                yield name, handle.get_tensor(name)
                bar.update(1)


def load_weights(model: Model, files: list[Path], *, progress: bool = True,
                 dequantizer: CheckpointDequantizer | None = None) -> None:
    """Fill every parameter of ``model`` from ``files`` (see :func:`load_tensors`), with the
    checkpoint's quantized weights made dense on the way when a ``dequantizer`` is given."""
    weights = iterate_weights(files, progress=progress)
    if dequantizer is not None:
        weights = dequantize_stream(weights, dequantizer)
    load_tensors(model, weights)


def load_tensors(model: Model, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Fill every parameter of ``model`` from ``(name, tensor)`` pairs, raising naming what is
    missing, then let each linear layer's method process what it loaded (quantize, repack)."""
    loaded = model.load_weights(weights)
    tied = tied_linear_layers(model)
    layers = {path: layer for path, layer in linear_layers(model).items() if path not in tied}
    in_layers = {f"{path}.{name}" for path, layer in layers.items() for name, _ in layer.named_parameters()}
    expected = {name for name, _ in model.named_parameters()} - in_layers
    missing = sorted(expected - loaded)
    missing += [f"{path}.{tensor}" for path, layer in layers.items() for tensor in layer.missing_tensors()]
    if missing:
        shown = ", ".join(missing[:10]) + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
        raise ValueError(f"The checkpoint did not provide these parameters: {shown}.")
    for layer in layers.values():
        layer.method.process_weights_after_loading(layer)
