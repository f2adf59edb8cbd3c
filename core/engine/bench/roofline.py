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
    read_gb_per_s: float = 0.0  # a plain streaming read of the same bytes: the memory's own limit


def measure_matvec_bandwidth(
    size: int = MATVEC_SIZE, dtype: torch.dtype = torch.bfloat16, reps: int = 20, warmup: int = 3
) -> MatvecBandwidth:
    """Time ``F.linear(x[1, size], W[size, size])`` (torch's decode path of a Linear layer)
    ``reps`` times after ``warmup`` untimed runs; bandwidth = bytes of W / median time.
    Also times a plain streaming read of the same bytes (their sum as fp32 words)."""
    weight = torch.full((size, size), 0.01, dtype=dtype)
    x = torch.full((1, size), 0.01, dtype=dtype)
    num_bytes = weight.numel() * weight.element_size()
    with torch.inference_mode():
        seconds = _median_seconds(lambda: torch.nn.functional.linear(x, weight), reps, warmup)
        # the same bytes summed as fp32 words (two 0.01 bf16 halves read as one finite fp32 value):
        # a streaming read that torch runs at the memory's speed
        words = weight.view(torch.float32) if weight.element_size() == 2 else weight
        read_seconds = _median_seconds(words.sum, reps, warmup)
    return MatvecBandwidth(
        bandwidth_gb_per_s(num_bytes, seconds),
        seconds,
        num_bytes,
        (size, size),
        str(dtype).removeprefix("torch."),
        reps,
        read_gb_per_s=bandwidth_gb_per_s(num_bytes, read_seconds),
    )


def _median_seconds(fn, reps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


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
