"""Group-quantized linear layers against bf16 ``F.linear`` on llama58m's shapes.

    python plugins/cpu/benchmarks/group_quant_bench.py [--rows 1 64] [--repeat 100] [--threads N]

For each layer shape (K inputs -> N outputs) and row count T, the fastest of ``--repeat`` calls of:
bf16 ``F.linear`` (the dense weight), engine-cpu's bf16 ``gemv`` where the build has it (what
its bf16 layers run for few rows), and engine-cpu's ``group_quant_linear`` kernel on the same
weight quantized to 4 bits in groups of 128 and of 32 and to 8 bits in groups of 128
(x in bf16 throughout), with the bytes each weight occupies and the ratio to bf16. Batch-1
decode reads every weight once a step, so at T=1 the time follows the bytes and the work of
unpacking them. A layer's weights that fit in the caches stay there from call to call, which a
whole model's would not. Each call is timed in turn with the others and the fastest kept: on a
machine shared with other work the figures still vary from run to run, so compare the ratios
measured together.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from engine.interfaces.group_quant import quantize_groups
from engine_cpu import native
from engine_cpu.linear import pack_gemv_weight
from engine_cpu.ops import NativeLayerOps

# llama58m: hidden 512, intermediate 1408, vocabulary 32000
SHAPES = {
    "qkv": (512, 1536),
    "o": (512, 512),
    "gate_up": (512, 2816),
    "down": (1408, 512),
    "head": (512, 32000),
}
FORMATS = (("4-bit g128", 4, 128), ("4-bit g32", 4, 32), ("8-bit g128", 8, 128))


def best_ms(repeat: int, calls: list) -> list[float]:
    """The fastest of ``repeat`` timings of each ``(fn, *args)`` in ``calls``, run in turn (so that
    a busy spell of the machine slows all of them, not one)."""
    for fn, *args in calls:
        for _ in range(3):
            fn(*args)
    best = [float("inf")] * len(calls)
    for _ in range(repeat):
        for i, (fn, *args) in enumerate(calls):
            start = time.perf_counter()
            fn(*args)
            best[i] = min(best[i], time.perf_counter() - start)
    return [t * 1e3 for t in best]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--repeat", type=int, default=100)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = native.load()
    if kernels is None:
        raise SystemExit("the engine-cpu kernels are unavailable (ENGINE_CPU_NATIVE=0 or no compiler)")
    ops = NativeLayerOps(kernels)
    gemv = kernels.gemv_supported()
    gen = torch.Generator().manual_seed(0)
    print(f"{native.cpu_model()}, {kernels.variant} kernels, {torch.get_num_threads()} threads")
    print(f"fastest of {args.repeat} calls in ms; x: the time of bf16 F.linear over it")
    names = ["bf16 F.linear", *(["bf16 gemv"] if gemv else []), *(name for name, _, _ in FORMATS)]
    header = f"{'layer':8} {'T':>4}" + "".join(f" {name:>13} {'x':>5}" for name in names)
    for rows in args.rows:
        print(header)
        totals = [0.0] * len(names)
        for layer, (k, n) in SHAPES.items():
            weight = torch.randn(n, k, generator=gen) * 0.02
            dense = weight.to(torch.bfloat16)
            x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
            calls = [(F.linear, x, dense)]
            if gemv:
                out = torch.empty(rows, n, dtype=torch.bfloat16)
                calls.append((kernels.gemv, out, x, pack_gemv_weight(dense), torch.empty(0, dtype=torch.bfloat16)))
            calls += [(ops.group_quant_linear, x, quantize_groups(weight, b, g)) for _, b, g in FORMATS]
            times = best_ms(args.repeat, calls)
            totals = [a + b for a, b in zip(totals, times)]
            print(f"{layer:8} {rows:>4}" + "".join(f" {t:13.3f} {times[0] / t:5.2f}" for t in times))
        print(f"{'sum':8} {rows:>4}" + "".join(f" {t:13.3f} {totals[0] / t:5.2f}" for t in totals))
    k, n = SHAPES["head"]
    sizes = {"bf16": n * k * 2}
    for name, bits, group_size in FORMATS:
        sizes[name] = quantize_groups(torch.zeros(n, k), bits, group_size).nbytes
    print("head weight: " + ", ".join(f"{name} {size / 2**20:.1f} MiB" for name, size in sizes.items()))


if __name__ == "__main__":
    main()
