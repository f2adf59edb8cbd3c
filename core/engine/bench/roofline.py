"""What a batch-1 decode step costs at best on this machine: the model's weights
read once at the matrix-vector bandwidth measured in the same run."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from engine.bench.metrics import bandwidth_gb_per_s

MATVEC_SIZE = 8192


@dataclass(frozen=True)
class MatvecBandwidth:
    gb_per_s: float
    seconds: float  # median time of one product
    num_bytes: int  # bytes of the matrix
    shape: tuple[int, int]
    dtype: str
    reps: int


def measure_matvec_bandwidth(
    size: int = MATVEC_SIZE, dtype: torch.dtype = torch.bfloat16, reps: int = 20, warmup: int = 3
) -> MatvecBandwidth:
    """Time ``F.linear(x[1, size], W[size, size])`` (the decode path of a Linear layer)
    ``reps`` times after ``warmup`` untimed runs; bandwidth = bytes of W / median time."""
    weight = torch.full((size, size), 0.01, dtype=dtype)
    x = torch.full((1, size), 0.01, dtype=dtype)
    times = []
    with torch.inference_mode():
        for _ in range(warmup):
            torch.nn.functional.linear(x, weight)
        for _ in range(reps):
            start = time.perf_counter()
            torch.nn.functional.linear(x, weight)
            times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    num_bytes = weight.numel() * weight.element_size()
    return MatvecBandwidth(
        bandwidth_gb_per_s(num_bytes, seconds), seconds, num_bytes, (size, size), str(dtype).removeprefix("torch."), reps
    )


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters a decode step reads in full: every parameter except
    those held only by embedding modules (a class whose name contains
    "Embedding"), which are gathered row by row. A table tied to the LM head is
    read by the head, so it counts."""
    read: dict[int, torch.Tensor] = {}
    for module in model.modules():
        if "Embedding" in type(module).__name__:
            continue
        for param in module.parameters(recurse=False):
            read[id(param)] = param
    return sum(p.numel() * p.element_size() for p in read.values())
