"""Streaming safetensors tensors (memory-mapped) into a model, with a progress bar.

Tensors come out as views of the memory-mapped file (copy-on-write: writing to one never
touches the file), so a layer that copies only its part (a tensor-parallel rank's rows or
columns) reads only that part from disk."""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from engine.interfaces.model import Model
from engine.layers.linear import linear_layers, tied_linear_layers
from engine.layers.moe import finish_experts
from engine.model_loader.checkpoint import GGUF_SUFFIX
from engine.model_loader.dequant import CheckpointDequantizer, dequantize_stream
from engine.model_loader.gguf import gguf_tensors

# safetensors dtype codes torch can view directly
MAPPED_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def read_header(path: Path) -> tuple[dict, int]:
    """A safetensors file's tensor table (``__metadata__`` left out) and where its data starts."""
    with open(path, "rb") as f:
        (header_size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_size))
    header.pop("__metadata__", None)
    return header, 8 + header_size


def mapped_tensors(path: Path, header: tuple[dict, int] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor of one safetensors file (its ``read_header``, when
    already read), as views of the file mapped copy-on-write; tensors of a dtype torch cannot
    view, or not aligned to their element size, are read by safetensors."""
    table, base = header or read_header(path)
    if not table:
        return
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    handle = None
    for name, entry in table.items():
        dtype = MAPPED_DTYPES.get(entry["dtype"])
        start, end = entry["data_offsets"]
        shape = entry["shape"]
        if dtype is None or (base + start) % dtype.itemsize:  # no view of this dtype, or misaligned
            handle = handle or safe_open(str(path), framework="pt", device="cpu")
            yield name, handle.get_tensor(name)
        elif end == start:
            yield name, torch.empty(shape, dtype=dtype)
        else:
            flat = torch.frombuffer(mapped, dtype=dtype, count=(end - start) // dtype.itemsize, offset=base + start)
            yield name, flat.view(shape)


def iterate_weights(files: list[Path], *, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor in ``files`` (safetensors, or a ``.gguf`` file:
    :func:`engine.model_loader.gguf.gguf_tensors`), one at a time, memory-mapped."""
    if len(files) == 1 and files[0].suffix == GGUF_SUFFIX:
        with tqdm(desc="Loading weights", unit="tensor", disable=not progress, leave=False) as bar:
            for item in gguf_tensors(files[0]):
                yield item
                bar.update(1)
        return
    headers = [read_header(path) for path in files]
    total = sum(len(table) for table, _ in headers)
    with tqdm(total=total, desc="Loading weights", unit="tensor", disable=not progress, leave=False) as bar:
        for path, header in zip(files, headers):
            for item in mapped_tensors(path, header):
                yield item
                bar.update(1)


def load_weights(
    model: Model, files: list[Path], *, progress: bool = True, dequantizer: CheckpointDequantizer | None = None
) -> None:
    """Fill every parameter of ``model`` from ``files`` (see :func:`load_tensors`), with the
    checkpoint's quantized weights made dense on the way when a ``dequantizer`` is given."""
    weights = iterate_weights(files, progress=progress)
    if dequantizer is not None:
        weights = dequantize_stream(weights, dequantizer)
    load_tensors(model, weights)


def load_tensors(model: Model, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Fill every parameter of ``model`` from ``(name, tensor)`` pairs, raising naming what is
    missing, then let quantized experts and each linear layer's method process what they
    loaded (quantize, repack)."""
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
    finish_experts(model)  # quantized experts: their staged tensors into the layout
    for layer in layers.values():
        layer.method.process_weights_after_loading(layer)
