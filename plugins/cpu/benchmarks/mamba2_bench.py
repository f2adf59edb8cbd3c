"""cpu_mamba2's Mamba-2 scan on one Nemotron-H-like layer: prefill and decode, against the
core's torch reference forms and a token-by-token recurrence, measured in the same run.

    python plugins/cpu/benchmarks/mamba2_bench.py
    python plugins/cpu/benchmarks/mamba2_bench.py --lengths 512 --batches 1 --dtypes bfloat16 --profile

The layer: d_model 1024 (32 heads of head_dim 64), state 128, 8 groups of B and C, convolution
kernel 4 (conv channels 32 · 64 + 2 · 8 · 128 = 4096). Each prefill is ``--batches`` fresh
sequences of ``--lengths`` tokens in one step; decode is one token for each of them, continuing
the prefilled state.

Runners (same inputs, same state slots):

- ``cpu_mamba2``: the backend's ``forward_mamba2`` (its prefill and decode forms);
- ``cpu_mamba2 (torch ops)``: its prefill without the native kernels (their torch fallbacks);
- ``cpu_mamba2 chunk N`` (``--chunk-sizes``): its prefill with chunks of N tokens;
- ``reference``: ``engine.kernels.mamba2_torch.forward_chunked`` / ``forward_decode``, the
  forms the backend ran before it had a CPU-specific prefill;
- ``per-token``: the prefill as ``length`` one-token decode steps (the recurrence token by
  token, batched over sequences); skipped above ``--per-token-max`` tokens, it is slow.

Every runner is timed in ``--repeat`` rounds, the runners taking turns, and its minimum kept:
on a machine shared with other work the minimum is the figure least disturbed by it. One torch
thread by default (``--threads``): on a busy machine two threads wait on each other. ``--profile``
prints torch.profiler's table of cpu_mamba2's prefill (native kernels as ``native.<name>``) and
of the reference's, for the first configuration.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from engine.interfaces.attention import MAMBA2, AttentionSpec
from engine.kernels import mamba2_torch
from engine.testing.kit.attention.base import make_common_metadata
from engine_cpu import mamba2 as mamba2_module
from engine_cpu.mamba2 import CpuMamba2

HEADS, HEAD_SIZE, STATE_SIZE, GROUPS, KERNEL = 32, 64, 128, 8, 4


def layer(dtype: torch.dtype, gen: torch.Generator):
    spec = AttentionSpec(
        MAMBA2,
        HEADS,
        HEADS,
        HEAD_SIZE,
        1.0,
        conv_kernel=KERNEL,
        state_size=STATE_SIZE,
        num_groups=GROUPS,
        dt_limit=(0.0, math.inf),
    )
    channels = spec.conv_channels
    weights = dict(
        conv_weight=(0.5 * torch.randn(channels, KERNEL, generator=gen)).to(dtype),
        conv_bias=(0.3 * torch.randn(channels, generator=gen)).to(dtype),
        dt_bias=0.5 * torch.randn(HEADS, generator=gen),
        A=-torch.exp(torch.rand(HEADS, generator=gen) * 2.5),
        D=torch.randn(HEADS, generator=gen),
    )
    return spec, weights


def metadata(backend: CpuMamba2, context: int, query: int, num_seqs: int):
    blocks = -(-(context + query) // 16)
    common = make_common_metadata(
        [context] * num_seqs, [query] * num_seqs, [[0] * blocks] * num_seqs, 16, torch.device("cpu"),
        list(range(num_seqs)),
    )  # fmt: skip
    return backend.build_metadata(common)


def best_of_rounds(repeat: int, runners: dict) -> dict[str, float]:
    """Each runner's fastest of ``repeat`` rounds, the runners taking turns within a round (so
    a slow minute of the machine falls on all of them alike)."""
    best = dict.fromkeys(runners, math.inf)
    for _ in range(repeat):
        for name, fn in runners.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


class Traced:
    """The native kernels module with each call a torch.profiler range (``native.<name>``)."""

    def __init__(self, kernels) -> None:
        self.kernels = kernels

    def __getattr__(self, name: str):
        function = getattr(self.kernels, name)

        def traced(*args):
            with torch.profiler.record_function(f"native.{name}"):
                return function(*args)

        return traced


def run_config(dtype: torch.dtype, num_seqs: int, length: int, args) -> list[tuple[str, str, float]]:
    gen = torch.Generator().manual_seed(0)
    spec, w = layer(dtype, gen)
    backend = CpuMamba2(spec, 16, dtype, torch.device("cpu"))
    torch_path = CpuMamba2(spec, 16, dtype, torch.device("cpu"))
    torch_path.kernels = None
    state = torch.zeros(backend.kv_cache_shape(num_seqs))
    xbc = torch.randn(num_seqs * length, spec.conv_channels, generator=gen).to(dtype)
    dt = torch.randn(num_seqs * length, HEADS, generator=gen).to(dtype)
    xbc_one = torch.randn(num_seqs, spec.conv_channels, generator=gen).to(dtype)
    dt_one = torch.randn(num_seqs, HEADS, generator=gen).to(dtype)
    prefill_meta = metadata(backend, 0, length, num_seqs)
    decode_meta = metadata(backend, length, 1, num_seqs)
    args_of = (w["conv_weight"], w["conv_bias"])
    rest = (w["dt_bias"], w["A"], w["D"])

    def prefill(form):
        return lambda: form(xbc, *args_of, dt, *rest, state, prefill_meta)

    def decode(form):
        return lambda: form(xbc_one, *args_of, dt_one, *rest, state, decode_meta)

    def per_token():
        first, later = metadata(backend, 0, 1, num_seqs), metadata(backend, 1, 1, num_seqs)
        rows = xbc.view(num_seqs, length, -1)
        steps = dt.view(num_seqs, length, -1)
        for t in range(length):
            mamba2_torch.forward_decode(
                spec, rows[:, t], *args_of, steps[:, t], *rest, state, first if t == 0 else later
            )

    def reference(form):
        return lambda *a: form(spec, *a)

    def with_chunk(size: int):
        def run():
            kept, mamba2_module.CHUNK = mamba2_module.CHUNK, size
            try:
                backend.forward_mamba2(xbc, *args_of, dt, *rest, state, prefill_meta)
            finally:
                mamba2_module.CHUNK = kept

        return run

    prefill_runners = {"cpu_mamba2": prefill(backend.forward_mamba2)}
    if backend.kernels is not None:
        prefill_runners["cpu_mamba2 (torch ops)"] = prefill(torch_path.forward_mamba2)
    prefill_runners.update({f"cpu_mamba2 chunk {size}": with_chunk(size) for size in args.chunk_sizes})
    prefill_runners["reference"] = prefill(reference(mamba2_torch.forward_chunked))
    decode_runners = {
        "cpu_mamba2": decode(backend.forward_mamba2),
        "reference": decode(reference(mamba2_torch.forward_decode)),
    }
    results = []
    with torch.inference_mode():
        for fn in prefill_runners.values():  # warm up: oneDNN builds its kernels for each new shape
            fn()
        for name, seconds in best_of_rounds(args.repeat, prefill_runners).items():
            results.append(("prefill", name, seconds))
        if length <= args.per_token_max:
            results.append(("prefill", "per-token", best_of_rounds(max(1, args.repeat // 3), {"": per_token})[""]))
        for name, seconds in best_of_rounds(args.repeat * 3, decode_runners).items():
            results.append(("decode", name, seconds))
        if args.profile:
            args.profile = False
            from torch.profiler import ProfilerActivity, profile

            if backend.kernels is not None:
                backend.kernels = Traced(backend.kernels)
            for label, fn in (
                ("cpu_mamba2", prefill(backend.forward_mamba2)),
                ("reference", prefill(reference(mamba2_torch.forward_chunked))),
            ):
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    fn()
                print(f"\n== prefill {label}: {dtype}, {num_seqs} x {length} tokens ==")
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--per-token-max", type=int, default=512)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--chunk-sizes", type=int, nargs="*", default=[], help="also time cpu_mamba2's prefill with these chunk sizes"
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (default 1: steadier on a shared machine)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; min of {args.repeat} runs (decode: of {args.repeat * 3})"
    )
    print(f"{'dtype':9} {'seqs':>4} {'tokens':>6} {'phase':8} {'runner':22} {'ms':>9} {'tok/s':>9} {'vs ours':>8}")
    for name in args.dtypes:
        dtype = getattr(torch, name)
        for num_seqs in args.batches:
            for length in args.lengths:
                results = run_config(dtype, num_seqs, length, args)
                ours = {phase: s for phase, runner, s in results if runner == "cpu_mamba2"}
                for phase, runner, seconds in results:
                    tokens = num_seqs * (length if phase == "prefill" else 1)
                    print(
                        f"{name:9} {num_seqs:>4} {length:>6} {phase:8} {runner:22} {seconds * 1e3:9.2f} "
                        f"{tokens / seconds:9.0f} {seconds / ours[phase]:7.2f}x",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
