"""One function per ``engine bench`` subcommand: build the workload, run it on the
engine and on the requested peers in this process, turn the timings into a Report.

The engine runs first and is dropped (KV cache included) before a peer loads.
Each runner gets one untimed warm-up request first.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, TypeVar

import torch

from engine.bench.engine_runner import (
    ATTENTION, LOGITS, PREPARE, PROCESS, SAMPLE, SCHEDULE, UPDATE, DecodeBreakdown, EngineRunner, StepRecord,
    decode_breakdown,
)
from engine.bench.hf_peer import HFPeer
from engine.bench.metrics import (
    RequestTiming, decode_step_seconds, decode_tokens_per_s, prefix_figures, ratio, tokens_per_s, weight_read_seconds,
)
from engine.bench.report import ENGINE, Report, Section
from engine.bench.roofline import measure_matvec_bandwidth
from engine.bench.workloads import (
    ALL_AT_ONCE, SEQUENTIAL, decode_workload, latency_workload, prefix_workload, throughput_workload, warmup_request,
)

PEERS = ("hf",)
HF_BATCH_SIZE = 16
MB = 1e6


class _Run(Protocol):
    wall: float


R = TypeVar("R", bound=_Run)


@dataclass(frozen=True)
class BenchOptions:
    model: str = "llama58m"
    dtype: str = "bfloat16"
    peers: tuple[str, ...] = ()
    scale: float = 1.0
    repeat: int = 1
    engine_settings: Mapping[str, Any] = field(default_factory=dict)
    """The engine's other settings, as EngineConfig fields (plugins, limits, quantization, speculative
    decoding): only those given, so the rest keep EngineConfig's defaults."""

    def __post_init__(self) -> None:
        unknown = [p for p in self.peers if p not in PEERS]
        if unknown:
            raise ValueError(f"Unknown peer(s) {', '.join(unknown)}. Available: {', '.join(PEERS)}.")
        if self.scale <= 0:
            raise ValueError(f"--scale must be positive, got {self.scale}.")
        if self.repeat < 1:
            raise ValueError(f"--repeat must be at least 1, got {self.repeat}.")


class _Session:
    """The model, the runners' order and the report's setup lines of one bench command."""

    def __init__(self, command: str, options: BenchOptions) -> None:
        from engine.model_loader.checkpoint import resolve_model_path

        self.options = options
        self.model_path: Path = resolve_model_path(options.model)
        with open(self.model_path / "config.json", encoding="utf-8") as f:
            self.vocab_size = int(json.load(f)["vocab_size"])
        self.warmup = warmup_request(self.vocab_size)
        self.repeat_walls: dict[str, list[str]] = {}
        self.report = Report(command, [ENGINE, *options.peers], {
            "model": options.model if str(self.model_path) == options.model else f"{options.model} ({self.model_path})",
            "dtype": options.dtype,
            "torch": f"{torch.__version__}, {torch.get_num_threads()} threads",
            "scale": options.scale,
            "machine": f"{os.cpu_count()} CPUs, 1-minute load average {os.getloadavg()[0]:.2f} at start",
        })
        self.report.notes.append(
            f"Each runner first completes one untimed warm-up request (prompt {self.warmup.prompt_len}, "
            f"{self.warmup.output_len} output tokens), so one-time costs stay out of the figures. "
            "Times are time.perf_counter() wall clock; greedy, EOS ignored, exact output lengths."
        )
        if options.scale != 1:
            self.report.notes.append(
                f"--scale {options.scale}: counts and lengths are scaled, so these are NOT the WORKLOADS.md "
                "workloads; a smoke test only."
            )

    def median_run(self, section: str, runner: str, run: Callable[[], R], reset: Callable[[], None] | None = None) -> R:
        """``run()`` ``--repeat`` times (``reset()`` before each) and the run of median wall time
        (the lower of the middle two for an even count); the walls go into the section's note."""
        runs = []
        for _ in range(self.options.repeat):
            if reset is not None:
                reset()
            runs.append(run())
        if len(runs) > 1:
            walls = ", ".join(f"{r.wall:.2f}" for r in runs)
            self.repeat_walls.setdefault(section, []).append(f"{runner} {walls} s")
        return sorted(runs, key=lambda r: r.wall)[(len(runs) - 1) // 2]

    def spec_note(self, section: Section, engine: EngineRunner) -> None:
        """Speculative decoding's counters over every engine run of the section (warm-up included)."""
        stats = engine.spec_stats()
        if stats is None:
            return
        by_position = ", ".join(f"{rate:.0%}" for rate in stats.acceptance_by_position())
        section.facts["speculative"] = {
            "rounds": stats.rounds, "proposed": stats.proposed, "accepted": stats.accepted,
            "acceptance_rate": stats.acceptance_rate, "acceptance_by_position": stats.acceptance_by_position(),
            "mean_accepted_length": stats.mean_accepted_length,
        }
        section.notes.append(
            f"Speculative decoding over the engine's runs: {stats.proposed} drafts verified in {stats.rounds} rounds, "
            f"{stats.accepted} accepted ({stats.acceptance_rate:.0%}; by draft position {by_position or 'none'}); "
            f"a round produced {stats.mean_accepted_length:.2f} tokens on average. With drafts, a step returns "
            "several tokens: the per-token figures count tokens, not steps."
        )

    def repeat_note(self, section: Section) -> None:
        walls = self.repeat_walls.get(section.key)
        if walls:
            section.notes.append(
                f"--repeat {self.options.repeat}: every figure of this section comes from each runner's run of "
                f"median wall time (engine runs start from an empty prefix cache); walls: {'; '.join(walls)}."
            )

    def engine(self) -> EngineRunner:
        o = self.options
        runner = EngineRunner(str(self.model_path), dtype=o.dtype, **{"plugins": None, **o.engine_settings})
        d = runner.describe()
        quantized = f", quantization {d['quantization']}" if d["quantization"] else ""
        if d["speculative"]:
            quantized += f", speculative {d['speculative']} (up to {runner.config.num_speculative_tokens} drafts)"
        self.report.setup["engine"] = (
            f"{d['architecture']} on {d['platform']} ({d['dtype']}{quantized}), max_num_seqs {d['max_num_seqs']}, "
            f"max_num_batched_tokens {d['max_num_batched_tokens']}, {d['kv_cache_blocks']} KV blocks of {d['block_size']}"
        )
        runner.warm_up(self.warmup)
        return runner

    def hf(self) -> HFPeer | None:
        if "hf" not in self.options.peers:
            return None
        peer = HFPeer(self.model_path, self.options.dtype)
        d = peer.describe()
        self.report.setup["hf"] = (
            f"transformers {d['transformers']} {d['class']} ({d['attn_implementation']} attention), generate, greedy"
        )
        peer.warm_up(self.warmup)
        return peer


# -------------------------------------------------------------------------
# W1 latency
# -------------------------------------------------------------------------


def run_latency(options: BenchOptions) -> Report:
    session = _Session("latency", options)
    workload = latency_workload(session.vocab_size, scale=options.scale)
    bandwidth = measure_matvec_bandwidth(dtype=getattr(torch, options.dtype))

    engine = session.engine()
    run = session.median_run("w1", ENGINE, lambda: engine.run(workload.requests, SEQUENTIAL), engine.reset_prefix_cache)
    timings: dict[str, RequestTiming] = {ENGINE: run.timings[0]}
    weights = {ENGINE: engine.weight_bytes()}
    breakdown = decode_breakdown(run.steps, 1, engine.timed_labels())
    engine.close()
    peer = session.hf()
    if peer is not None:
        timings[peer.name] = session.median_run("w1", peer.name, lambda: peer.run_sequential(workload.requests)).timings[0]
        weights[peer.name] = peer.weight_bytes()

    section = Section("w1", workload.name, workload.description)
    step = {r: decode_step_seconds(t) for r, t in timings.items()}
    read = {r: weight_read_seconds(b, bandwidth.gb_per_s) for r, b in weights.items()}
    section.add("ttft_ms", "time to first token", "ms", {r: t.ttft * 1e3 for r, t in timings.items()},
                "engine: add_request -> end of the step() that returned token 1; hf: generate() call -> a "
                "streamer receives token 1. Both include the prefill.")
    section.add("decode_tok_s", "decode tokens/s", "tok/s", {r: decode_tokens_per_s(t) for r, t in timings.items()},
                "(N - 1) / (t_N - t_1): tokens after the first over the time after the first; t_k is when token k "
                "was returned (engine: end of its step(); hf: streamer stamp) in the same single run.")
    section.add("decode_step_ms", "decode step time", "ms", {r: s * 1e3 for r, s in step.items()},
                "(t_N - t_1) / (N - 1), the inverse of the row above.")
    section.add("weight_read_ms", "weights read once at matvec bandwidth", "ms", {r: s * 1e3 for r, s in read.items()},
                "weight bytes / the matrix-vector bandwidth measured in this run (both in the note below).", ".2f")
    section.add("step_over_weight_read", "decode step / weight read (our overhead)", "x",
                {r: ratio(step[r], read[r]) for r in step},
                "decode step time / weight-read time: 1.0 is a batch-1 step at this machine's matvec bandwidth.", ".2f")
    memory_read = {r: weight_read_seconds(b, bandwidth.read_gb_per_s) for r, b in weights.items()}
    section.add("weight_stream_ms", "weights read once at memory read bandwidth", "ms",
                {r: s * 1e3 for r, s in memory_read.items()},
                "weight bytes / the plain streaming-read bandwidth measured in this run (note below): "
                "the memory's own limit, which a decode kernel can approach but not beat.", ".2f")
    section.add("step_over_weight_stream", "decode step / memory read", "x",
                {r: ratio(step[r], memory_read[r]) for r in step},
                "decode step time / memory-read time: 1.0 would be a step that only streams the weights.", ".2f")
    if breakdown is not None:
        section.add("model_ms", "model time per decode step", "ms", {ENGINE: breakdown.model_seconds * 1e3},
                    f"mean forward + logits phase time (the model's forward pass and LM head, from the engine's step "
                    f"timings) over the {breakdown.num_steps} decode steps.", ".2f")
        section.add("overhead_share", "engine overhead share of a decode step", "%", {ENGINE: breakdown.overhead_share},
                    "(step - model) / step over the same steps: scheduling, inputs, sampling, bookkeeping.")
    section.facts = {
        "matvec_gb_per_s": bandwidth.gb_per_s, "matvec_shape": list(bandwidth.shape), "matvec_dtype": bandwidth.dtype,
        "matvec_seconds": bandwidth.seconds, "read_gb_per_s": bandwidth.read_gb_per_s, "weight_bytes": weights,
    }
    section.notes.append(
        f"Matrix-vector bandwidth {bandwidth.gb_per_s:.1f} GB/s: F.linear of x[1, {bandwidth.shape[1]}] by "
        f"W{list(bandwidth.shape)} {bandwidth.dtype}, median of {bandwidth.reps}, bytes of W / time; memory read "
        f"bandwidth {bandwidth.read_gb_per_s:.1f} GB/s: a sum over the same bytes read as fp32 words. Weights read per "
        "step: " + ", ".join(f"{r} {b / MB:.1f} MB" for r, b in weights.items())
        + " (every parameter except the embedding table, which is only gathered)."
    )
    session.spec_note(section, engine)
    session.repeat_note(section)
    session.report.sections.append(section)
    return session.report


# -------------------------------------------------------------------------
# W2 throughput, and engine overhead at 64 decoding sequences
# -------------------------------------------------------------------------


def run_throughput(options: BenchOptions) -> Report:
    session = _Session("throughput", options)
    workload = throughput_workload(session.vocab_size, scale=options.scale)
    decode = decode_workload(session.vocab_size, scale=options.scale)

    engine = session.engine()
    w2 = session.median_run("w2", ENGINE, lambda: engine.run(workload.requests, ALL_AT_ONCE), engine.reset_prefix_cache)
    w2_model_seconds = sum(s.model_seconds for s in w2.steps)
    decode_run = engine.run(decode.requests, ALL_AT_ONCE)
    labels = engine.timed_labels()
    breakdown = decode_breakdown(decode_run.steps, len(decode.requests), labels)
    engine.close()
    walls = {ENGINE: w2.wall}
    peer = session.hf()
    if peer is not None:
        walls[peer.name] = session.median_run(
            "w2", peer.name, lambda: peer.run_static_batches(workload.requests, HF_BATCH_SIZE)
        ).wall

    section = Section("w2", workload.name, workload.description)
    out_tokens, all_tokens = workload.num_output_tokens, workload.num_prompt_tokens + workload.num_output_tokens
    section.add("output_tok_s", "output tokens/s", "tok/s", {r: tokens_per_s(out_tokens, w) for r, w in walls.items()},
                f"the workload's {out_tokens} stated output tokens / wall seconds.")
    section.add("total_tok_s", "total tokens/s", "tok/s", {r: tokens_per_s(all_tokens, w) for r, w in walls.items()},
                f"({workload.num_prompt_tokens} prompt + {out_tokens} output tokens) / wall seconds.")
    section.add("wall_s", "wall time", "s", {r: w for r, w in walls.items()},
                "engine: all requests added, then step() until the last finished; hf: static batches of "
                f"{HF_BATCH_SIZE} in order, left-padded with an attention mask, each generating max(output_len) "
                "of its members (tokens past a request's own length are computed but not counted).", ".2f")
    section.add("model_share", "model time share of wall", "%", {ENGINE: w2_model_seconds / w2.wall},
                f"forward + logits phase time (the model's compute) over all {len(w2.steps)} steps / wall.")
    prefill_steps = [s for s in w2.steps if not s.all_decode]
    section.add("prefill_steps_s", "time in steps with prompt tokens", "s",
                {ENGINE: sum(s.seconds for s in prefill_steps)},
                f"step() time of the {len(prefill_steps)} steps that computed prompt tokens (alone or with decodes); "
                f"the other {len(w2.steps) - len(prefill_steps)} steps only decoded.", ".2f")
    session.spec_note(section, engine)
    session.repeat_note(section)
    session.report.sections.append(section)
    session.report.sections.append(_overhead_section(decode.name, decode.description, breakdown, labels))
    return session.report


# the step phases outside the model, in step order, and what each does
_OVERHEAD_PHASES = (
    (SCHEDULE, "scheduling (scheduler.schedule)"),
    (PREPARE, "building inputs and attention metadata"),
    (SAMPLE, "sampling (and draft verification)"),
    (UPDATE, "appending tokens, stop checks (update_from_output)"),
    (PROCESS, "output processing (logprobs, finished requests)"),
)


def _overhead_section(title: str, description: str, breakdown: DecodeBreakdown | None, labels: list[str]) -> Section:
    section = Section("decode_overhead", f"engine {title}", description)
    if breakdown is None:
        section.notes.append(
            "No step decoded all the requests at once (is --max-num-seqs below the request count?); nothing measured."
        )
        return section
    b = breakdown
    over = f"the {b.num_steps} steps that decoded all {b.num_seqs} sequences and nothing else"
    section.add("step_ms", "step time", "ms", {ENGINE: b.step_seconds * 1e3}, f"mean engine.step() wall time over {over}.")
    section.add("model_ms", "model time", "ms", {ENGINE: b.model_seconds * 1e3},
                "mean forward + logits phase time of the engine's step timings (the model's compute) in those steps.")
    if LOGITS in b.parts:
        section.add("logits_ms", "  of which compute_logits (LM head)", "ms", {ENGINE: b.parts[LOGITS] * 1e3},
                    "mean logits phase time: model.compute_logits (inside the model time).")
    if ATTENTION in b.parts:
        section.add("attention_ms", "  of which attention layers", "ms", {ENGINE: b.parts[ATTENTION] * 1e3},
                    "mean time in the Attention layers' forward, timed by forward hooks (inside the model time).")
    section.add("overhead_ms", "engine overhead", "ms", {ENGINE: b.overhead_seconds * 1e3},
                "step - model: everything but the model's compute (scheduling, building inputs and attention "
                "metadata, sampling, appending tokens, stop checks).")
    for label, text in _OVERHEAD_PHASES:
        if label in b.parts:
            section.add(f"{label}_ms", f"  of which {text}", "ms", {ENGINE: b.parts[label] * 1e3},
                        f"mean {label} phase time of the engine's step timings (inside the overhead).", ".2f")
    section.add("overhead_share", "overhead share", "%", {ENGINE: b.overhead_share}, "(step - model) / step.")
    section.facts = {"num_steps": b.num_steps, "num_seqs": b.num_seqs, "timed_labels": labels}
    return section


# -------------------------------------------------------------------------
# W3 shared prefix
# -------------------------------------------------------------------------


def run_prefix(options: BenchOptions) -> Report:
    session = _Session("prefix", options)
    workload = prefix_workload(session.vocab_size, scale=options.scale)

    engine = session.engine()
    run = session.median_run("w3", ENGINE, lambda: engine.run(workload.requests, SEQUENTIAL), engine.reset_prefix_cache)
    first_prefill = _until_first_token(run.steps)
    engine.close()
    runs = {ENGINE: (run.timings, run.wall)}
    peer = session.hf()
    if peer is not None:
        peer_run = session.median_run("w3", peer.name, lambda: peer.run_sequential(workload.requests))
        runs[peer.name] = (peer_run.timings, peer_run.wall)

    figures = {r: prefix_figures(timings) for r, (timings, _) in runs.items()}
    n = len(workload.requests)
    section = Section("w3", workload.name, workload.description)
    section.add("ttft_first_ms", "time to first token, request 1", "ms",
                {r: f.first_ttft * 1e3 for r, f in figures.items()},
                "submit -> token 1 of the first request (engine: add_request -> end of its step(); hf: generate() "
                "call -> streamer stamp); it computes the whole prompt.")
    section.add("ttft_rest_ms", f"mean time to first token, requests 2..{n}", "ms",
                {r: f.rest_mean_ttft * 1e3 for r, f in figures.items()},
                "the same for each later request, averaged; these can reuse the shared prefix if the runner caches "
                "it (HF generate recomputes it).")
    section.add("ttft_ratio", f"TTFT 2..{n} / TTFT 1", "x", {r: f.rest_over_first for r, f in figures.items()},
                "row 2 / row 1: below 1 the shared prefix is served from cache.", ".2f")
    section.add("wall_s", "wall time", "s", {r: wall for r, (_, wall) in runs.items()},
                "first submit -> last request finished, requests one after another.", ".2f")
    section.add("first_prefill_model_ms", "request 1 prefill: model time", "ms",
                {ENGINE: sum(s.model_seconds for s in first_prefill) * 1e3},
                f"forward + logits phase time in the {len(first_prefill)} step(s) up to request 1's first token.")
    if any(ATTENTION in s.timed for s in first_prefill):
        section.add("first_prefill_attention_ms", "  of which attention layers", "ms",
                    {ENGINE: sum(s.timed.get(ATTENTION, 0.0) for s in first_prefill) * 1e3},
                    "time in the Attention layers' forward (forward hooks) in the same step(s).")
    session.spec_note(section, engine)
    session.repeat_note(section)
    session.report.sections.append(section)
    return session.report


def _until_first_token(steps: list[StepRecord]) -> list[StepRecord]:
    """The steps of a run up to and including the first that sampled a token."""
    for i, step in enumerate(steps):
        if step.num_sampled:
            return steps[: i + 1]
    return list(steps)


COMMANDS: dict[str, Callable[[BenchOptions], Report]] = {
    "latency": run_latency,
    "throughput": run_throughput,
    "prefix": run_prefix,
}


def run_bench(command: str, options: BenchOptions) -> Report:
    if command not in COMMANDS:
        raise ValueError(f"Unknown bench workload {command!r}. Available: {', '.join(COMMANDS)}.")
    report = COMMANDS[command](options)
    report.setup["machine"] += (
        f", {os.getloadavg()[0]:.2f} at end (this run adds about 1-2; more means other work shared the CPUs "
        "and skewed every figure)"
    )
    return report
