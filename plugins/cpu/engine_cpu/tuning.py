"""Kernels chosen by measurement: which linear kernel runs for each weight shape and row count.

What is fastest differs between CPUs (an AMX Xeon's oneDNN beats a packed-weight kernel from
a few rows on; an AMD EPYC's does not), so at start-up the candidates are timed on the
model's own layers, in model order (a decode step's weights come from memory, not from a
cache warmed by timing one layer again and again), at the row counts of :data:`ROW_BANDS`,
and each (shape, band) gets the fastest. Results are kept in a JSON file beside the kernel
builds (``<kernel cache>/../tuning.json``, or ``ENGINE_CPU_TUNING_FILE``), keyed by CPU model, thread count, torch version,
kernel build and shape, so later starts measure nothing.

``ENGINE_CPU_TUNING=0`` skips the measurement (each method's fixed rule then applies);
``ENGINE_CPU_TUNING=fresh`` measures again and replaces what is stored.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch
from torch import nn

logger = logging.getLogger("engine.cpu")

# a band covers the row counts above the previous bound up to its own; it is timed at its bound;
# the last covers every row count above the one before it (long prefill chunks), timed at its
# bound. Short and long prefill chunks are bands of their own: a tile kernel that wins at a few
# hundred rows can lose to oneDNN's blocking from a couple of thousand on (an AMX Xeon).
ROW_BANDS = (1, 2, 4, 8, 16, 32, 64, 512, 2048)
# the measurement stops adding repeats once it has taken this long
BUDGET_SECONDS = 4.0
MAX_REPEATS = 5
# a candidate this many times slower than the fastest in a band, for every shape, in the first
# counted repeat is not timed again there: the budget goes to repeats of the ones in contention
# (a packed-weight gemv takes ten times oneDNN's time at 2048 rows, most of a repeat)
OUT_OF_CONTENTION = 3.0

Kernel = Callable[[nn.Module, torch.Tensor], torch.Tensor]


def band_of(rows: int) -> int:
    """The index of the band holding ``rows`` (>= 1; the last band holds every count above the
    bound before it)."""
    return min(bisect.bisect_left(ROW_BANDS, rows), len(ROW_BANDS) - 1)


def mode() -> str:
    value = os.environ.get("ENGINE_CPU_TUNING", "1").strip().lower()
    if value in ("0", "false", "off"):
        return "off"
    return "fresh" if value == "fresh" else "on"


def store_path() -> Path:
    from engine_cpu.native import cache_root

    configured = os.environ.get("ENGINE_CPU_TUNING_FILE")
    return Path(configured) if configured else cache_root().parent / "tuning.json"


@dataclass(frozen=True)
class Measured:
    """The fastest candidate of each band for one shape, and every candidate's time there."""

    choice: tuple[str, ...]
    seconds: tuple[Mapping[str, float], ...]


def context_key(candidates: Sequence[str], dtype: torch.dtype, kernel_build: str) -> str:
    from engine_cpu.native import cpu_model

    return "|".join(
        [
            cpu_model(),
            f"{torch.get_num_threads()} threads",
            f"torch {torch.__version__}",
            f"kernels {kernel_build}",
            str(dtype).removeprefix("torch."),
            ",".join(candidates),
        ]
    )


def shape_of(layer: nn.Module) -> tuple[int, int]:
    return int(sum(layer.output_sizes)), int(layer.input_size)


def _load_store(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _save_store(path: Path, data: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(f.name, path)
    except OSError as exc:  # a read-only home: measure again next time
        logger.warning("could not store the kernel measurements in %s: %s", path, exc)


def choose(
    layers: Sequence[nn.Module],
    candidates: Mapping[str, Kernel],
    dtype: torch.dtype,
    kernel_build: str,
    path: Path | None = None,
) -> dict[tuple[int, int], Measured]:
    """The fastest of ``candidates`` for every shape among ``layers`` and every band: from the
    store where it has them, measured (and stored) where it does not."""
    path = store_path() if path is None else path
    names = sorted(candidates)
    context = context_key(names, dtype, kernel_build)
    store = _load_store(path) if mode() != "fresh" else {}
    known = store.get(context, {})
    shapes = sorted({shape_of(layer) for layer in layers})
    result: dict[tuple[int, int], Measured] = {}
    for shape in shapes:
        entry = known.get(f"{shape[0]}x{shape[1]}")
        if isinstance(entry, dict) and len(entry.get("choice", ())) == len(ROW_BANDS):
            seconds = tuple({k: float(v) for k, v in band.items()} for band in entry["seconds"])
            result[shape] = Measured(tuple(entry["choice"]), seconds)
    missing = [layer for layer in layers if shape_of(layer) not in result]
    if missing:
        start = time.perf_counter()
        measured = measure(missing, candidates, dtype)
        logger.info(
            "timed %d linear kernels on %d layer shapes at %d row counts in %.1f s",
            len(candidates),
            len(measured),
            len(ROW_BANDS),
            time.perf_counter() - start,
        )
        result.update(measured)
        store = _load_store(path)  # another process may have stored meanwhile
        entries = store.setdefault(context, {})
        for shape, m in measured.items():
            entries[f"{shape[0]}x{shape[1]}"] = {"choice": list(m.choice), "seconds": [dict(s) for s in m.seconds]}
        _save_store(path, store)
    return result


def measure(
    layers: Sequence[nn.Module], candidates: Mapping[str, Kernel], dtype: torch.dtype
) -> dict[tuple[int, int], Measured]:
    """Times each candidate over all ``layers`` in order, per band; per shape, the time of a
    band is the sum over that shape's layers, and the best of the repeats counts. After the
    first counted repeat, a band stops timing the candidates out of contention there
    (:data:`OUT_OF_CONTENTION`); their first time stays their time."""
    inputs = {}
    gen = torch.Generator().manual_seed(0)
    for layer in layers:
        k = int(layer.input_size)
        if k not in inputs:
            inputs[k] = torch.randn(ROW_BANDS[-1], k, generator=gen).to(dtype)
    best: dict[tuple[int, int], list[dict[str, float]]] = {shape_of(layer): [{} for _ in ROW_BANDS] for layer in layers}
    spent = 0.0
    dropped: set[tuple[int, str]] = set()  # (band, candidate) no longer timed
    for repeat in range(MAX_REPEATS + 1):  # the first pass warms up and is not counted
        start = time.perf_counter()
        for b, rows in enumerate(ROW_BANDS):
            for name, kernel in candidates.items():
                if (b, name) in dropped:
                    continue
                totals: dict[tuple[int, int], float] = {}
                for layer in layers:
                    x = inputs[int(layer.input_size)][:rows]
                    t0 = time.perf_counter()
                    kernel(layer, x)
                    shape = shape_of(layer)
                    totals[shape] = totals.get(shape, 0.0) + time.perf_counter() - t0
                if repeat:
                    for shape, seconds in totals.items():
                        band = best[shape][b]
                        band[name] = min(band.get(name, float("inf")), seconds)
        spent += time.perf_counter() - start
        if repeat == 1:
            for b in range(len(ROW_BANDS)):
                for name in candidates:
                    if all(bands[b][name] > OUT_OF_CONTENTION * min(bands[b].values()) for bands in best.values()):
                        dropped.add((b, name))
        if repeat and spent >= BUDGET_SECONDS:
            break
    return {
        shape: Measured(tuple(min(band, key=band.get) for band in bands), tuple(bands)) for shape, bands in best.items()
    }
