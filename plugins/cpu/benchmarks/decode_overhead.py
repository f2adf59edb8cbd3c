"""Where a batched decode step's CPU time goes outside the kernels, on llama58m and W2.

Runs W2 (64 requests, all at once) through ``LLMEngine`` with the cpu plugin, and profiles
the steps that only decode: cProfile (functions: calls and tottime per step) and
torch.profiler (ops: count per step and self CPU time, the heavy kernels apart from the
rest). CPU time (``time.process_time``) rather than wall time: the machine may be shared.
The minimum of ``--repeats`` runs is reported.

The cpu plugin's native kernels (``engine_cpu_kernels*``: its linear, attention and fused
layer ops) are called from Python, not through aten: torch.profiler does not see them, and
the cProfile summary counts them as kernels and everything else as glue. The linear kernels
are chosen by timing them at start-up, so a busy machine may choose others from run to run
(and outputs then differ in rounding): compare runs that chose the same ones.

    python plugins/cpu/benchmarks/decode_overhead.py [--repeats 3] [--top 25] [--no-async]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from collections import Counter, defaultdict

import torch

NATIVE_KERNELS = ("engine_cpu_kernels", "mkldnn._linear_pointwise")
HEAVY = ("linear", "mm", "addmm", "matmul", "paged_attention", "prefill_attention", "cache_write", "mkldnn")


def run(engine, workload, *, profile=None, torch_prof=None, decode_only=True):
    from engine.sampling_params import SamplingParams

    for i, r in enumerate(workload.requests):
        params = SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
        engine.add_request(f"r{run.count}-{i}", list(r.prompt_token_ids), params)
    run.count += 1
    decode_cpu, decode_steps, other_cpu, outputs = 0.0, 0, 0.0, {}
    while engine.scheduler.has_unfinished():
        decoding = all(r.num_computed_tokens >= r.num_prompt_tokens for r in engine.scheduler.running) and not (
            engine.scheduler.waiting
        )
        active = decoding and decode_only
        if active and profile is not None:
            profile.enable()
        if active and torch_prof is not None:
            torch_prof.__enter__()
        start = time.process_time()
        result = engine.step()
        seconds = time.process_time() - start
        if active and torch_prof is not None:
            torch_prof.__exit__(None, None, None)
            torch_prof = None  # one step is enough for op counts
        if active and profile is not None:
            profile.disable()
        if decoding:
            decode_cpu += seconds
            decode_steps += 1
        else:
            other_cpu += seconds
        for request in result.finished:
            outputs[request.request_id.split("-", 1)[1]] = list(request.output_token_ids)
    return decode_cpu, decode_steps, other_cpu, outputs


run.count = 0


def print_glue(stats: pstats.Stats, steps: int, top: int) -> None:
    """Per decode step: the kernels' time, the rest's (glue) and its calls, its top functions."""
    kernels = glue = calls = 0.0
    rows = []
    for (file, line, name), (_, num_calls, tottime, _, _) in stats.stats.items():
        label = name if file == "~" else f"{file}:{line}({name})"
        if any(k in label for k in NATIVE_KERNELS):
            kernels += tottime
            continue
        glue, calls = glue + tottime, calls + num_calls
        rows.append((tottime, num_calls, label))
    print(
        f"per decode step: kernels {kernels / steps * 1e3:.2f} ms, glue {glue / steps * 1e3:.2f} ms "
        f"in {calls / steps:.0f} calls (cProfile's own cost included)"
    )
    for tottime, num_calls, label in sorted(rows, reverse=True)[:top]:
        print(f"  {tottime / steps * 1e3:7.3f} ms {num_calls / steps:7.1f}/step  {label}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--no-async", action="store_true", help="async_scheduling off (profiles the forward too)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--save-outputs", help="write the sampled tokens here (json) to compare runs")
    parser.add_argument("--stats-out", help="write cProfile's stats here (pstats format)")
    parser.add_argument("--no-ops", action="store_true", help="leave out the torch.profiler run")
    args = parser.parse_args()

    from engine.bench.workloads import throughput_workload
    from engine.builtin_models import ensure
    from engine.config import EngineConfig
    from engine.engine.llm_engine import LLMEngine

    settings = {"plugins": "cpu,llama", "dtype": args.dtype}
    if args.no_async:
        settings["async_scheduling"] = False
    engine = LLMEngine(EngineConfig(model=str(ensure("llama58m")), **settings), progress=False)
    workload = throughput_workload(engine.vocab_size)
    print(f"async scheduling: {engine.async_scheduling}, threads {torch.get_num_threads()}")

    outputs = run(engine, workload)[3]  # warm-up
    best = (float("inf"), 1)
    for _ in range(args.repeats):
        engine.reset_prefix_cache()
        wall = time.perf_counter()
        decode_cpu, steps, other_cpu, outputs = run(engine, workload)
        wall = time.perf_counter() - wall
        print(
            f"  run: wall {wall:.3f} s, decode {steps} steps {decode_cpu:.3f} s CPU, other steps {other_cpu:.3f} s CPU"
        )
        best = min(best, (decode_cpu, steps))
    if args.repeats:
        print(
            f"decode CPU time (min of {args.repeats}): {best[0]:.3f} s over {best[1]} steps, {best[0] / best[1] * 1e3:.2f} ms/step"
        )
    if args.save_outputs:
        import json

        with open(args.save_outputs, "w") as f:
            json.dump(outputs, f, sort_keys=True)

    # functions
    engine.reset_prefix_cache()
    profile = cProfile.Profile()
    _, steps, _, _ = run(engine, workload, profile=profile)
    stream = io.StringIO()
    stats = pstats.Stats(profile, stream=stream)
    stats.sort_stats("tottime").print_stats(args.top)
    if args.stats_out:
        profile.dump_stats(args.stats_out)
    print(f"cProfile over {steps} decode steps (divide by it for per step):")
    print(stream.getvalue())
    print_glue(stats, steps, args.top)

    if args.no_ops:
        return
    # ops of one decode step
    engine.reset_prefix_cache()
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    run(engine, workload, torch_prof=prof)
    counts, times = Counter(), defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CPU:
            counts[event.name] += 1
            times[event.name] += event.self_cpu_time_total
    heavy = {name for name in counts if any(h in name for h in HEAVY)}
    total = sum(times.values())
    heavy_us = sum(times[n] for n in heavy)
    print(
        f"ops in one decode step: {sum(counts.values())} ({sum(counts[n] for n in heavy)} heavy); self CPU "
        f"{total / 1e3:.2f} ms, heavy {heavy_us / 1e3:.2f} ms, rest {(total - heavy_us) / 1e3:.2f} ms"
    )
    for name, n in sorted(counts.items(), key=lambda kv: -times[kv[0]]):
        print(f"  {'H' if name in heavy else ' '} {n:5d} {times[name] / 1e3:8.3f} ms  {name}")


if __name__ == "__main__":
    main()
