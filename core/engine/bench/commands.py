"""One function per ``engine bench`` subcommand: build the workload, run it on the
engine and on the requested peers in this process, turn the timings into a Report.

The engine runs first and is dropped (KV cache included) before a peer loads.
Each runner gets one untimed warm-up request first.
"""

from __future__ import annotations

import os
from typing import Callable

import torch

from engine.bench.engine_runner import (
    ATTENTION,
    decode_breakdown,
)
from engine.bench.metrics import (
    RequestTiming,
    decode_kv_read_bytes,
    decode_step_seconds,
    decode_tokens_per_s,
    prefix_figures,
    ratio,
    tokens_per_s,
    weight_read_seconds,
)
from engine.bench.process_peers import PROCESS_PEERS
from engine.bench.report import ENGINE, Report, Section
from engine.bench.roofline import measure_matvec_bandwidth
from engine.bench.sections import overhead_section, until_first_token
from engine.bench.session import HF_BATCH_SIZE, MB, BenchOptions, Session
from engine.bench.workloads import (
    ALL_AT_ONCE,
    SEQUENTIAL,
    decode_workload,
    latency_workload,
    prefix_workload,
    repetition_workload,
    throughput_workload,
)


def peer_methods(engine: str, peers: dict[str, str], runners: tuple[str, ...]) -> str:
    """A figure's method: the engine's, then that of each peer in ``runners``, in their order."""
    return "; ".join([engine, *(f"{p}: {peers[p]}" for p in runners if p in peers)]) + "."


def run_latency(options: BenchOptions) -> Report:
    session = Session("latency", options)
    workload = latency_workload(session.vocab_size, scale=options.scale)
    bandwidth = measure_matvec_bandwidth(dtype=getattr(torch, options.dtype))

    engine = session.engine()
    run = session.median_run("w1", ENGINE, lambda: engine.run(workload.requests, SEQUENTIAL), engine.reset_prefix_cache)
    timings: dict[str, RequestTiming] = {ENGINE: run.timings[0]}
    weights = {ENGINE: engine.weight_bytes()}
    breakdown = decode_breakdown(run.steps, 1, engine.timed_labels())
    engine.close()
    peer_runs, peer_weights = session.peer_runs("w1", workload)
    timings.update({name: peer_run.timings[0] for name, peer_run in peer_runs.items()})
    weights.update(peer_weights)

    section = Section("w1", workload.name, workload.description)
    step = {r: decode_step_seconds(t) for r, t in timings.items()}
    read = {r: weight_read_seconds(b, bandwidth.gb_per_s) for r, b in weights.items()}
    section.add(
        "ttft_ms",
        "time to first token",
        "ms",
        {r: t.ttft * 1e3 for r, t in timings.items()},
        peer_methods(
            "engine: add_request -> end of the step() that returned token 1",
            {
                "hf": "generate() call -> a streamer receives token 1",
                "vllm": "add_request -> end of the LLMEngine.step() that returned token 1",
                "llamacpp": "llama_decode of the prompt -> token 1 sampled",
            },
            session.peers,
        )
        + " Each includes the prefill.",
    )
    section.add(
        "decode_tok_s",
        "decode tokens/s",
        "tok/s",
        {r: decode_tokens_per_s(t) for r, t in timings.items()},
        "(N - 1) / (t_N - t_1): tokens after the first over the time after the first; t_k is when token k "
        "was returned ("
        + peer_methods(
            "engine: end of its step()",
            {"hf": "streamer stamp", "vllm": "end of its step()", "llamacpp": "once sampled after its llama_decode"},
            session.peers,
        ).removesuffix(".")
        + ") in the same single run.",
    )
    section.add(
        "decode_step_ms",
        "decode step time",
        "ms",
        {r: s * 1e3 for r, s in step.items()},
        "(t_N - t_1) / (N - 1), the inverse of the row above.",
    )
    section.add(
        "weight_read_ms",
        "weights read once at matvec bandwidth",
        "ms",
        {r: s * 1e3 for r, s in read.items()},
        "weight bytes / the matrix-vector bandwidth measured in this run (both in the note below).",
        ".2f",
    )
    section.add(
        "step_over_weight_read",
        "decode step / weight read (our overhead)",
        "x",
        {r: ratio(step[r], read[r]) for r in step},
        "decode step time / weight-read time: 1.0 is a batch-1 step at this machine's matvec bandwidth.",
        ".2f",
    )
    memory_read = {r: weight_read_seconds(b, bandwidth.read_gb_per_s) for r, b in weights.items()}
    section.add(
        "weight_stream_ms",
        "weights read once at memory read bandwidth",
        "ms",
        {r: s * 1e3 for r, s in memory_read.items()},
        "weight bytes / the plain streaming-read bandwidth measured in this run (note below): "
        "the memory's own limit, which a decode kernel can approach but not beat.",
        ".2f",
    )
    section.add(
        "step_over_weight_stream",
        "decode step / memory read",
        "x",
        {r: ratio(step[r], memory_read[r]) for r in step},
        "decode step time / memory-read time: 1.0 would be a step that only streams the weights.",
        ".2f",
    )
    if breakdown is not None:
        section.add(
            "model_ms",
            "model time per decode step",
            "ms",
            {ENGINE: breakdown.model_seconds * 1e3},
            f"mean forward + logits phase time (the model's forward pass and LM head, from the engine's step "
            f"timings) over the {breakdown.num_steps} decode steps.",
            ".2f",
        )
        section.add(
            "overhead_share",
            "engine overhead share of a decode step",
            "%",
            {ENGINE: breakdown.overhead_share},
            "(step - model) / step over the same steps: scheduling, inputs, sampling, bookkeeping.",
        )
    section.facts = {
        "matvec_gb_per_s": bandwidth.gb_per_s,
        "matvec_shape": list(bandwidth.shape),
        "matvec_dtype": bandwidth.dtype,
        "matvec_seconds": bandwidth.seconds,
        "read_gb_per_s": bandwidth.read_gb_per_s,
        "weight_bytes": weights,
    }
    section.notes.append(
        f"Matrix-vector bandwidth {bandwidth.gb_per_s:.1f} GB/s: F.linear of x[1, {bandwidth.shape[1]}] by "
        f"W{list(bandwidth.shape)} {bandwidth.dtype}, median of {bandwidth.reps}, bytes of W / time; memory read "
        f"bandwidth {bandwidth.read_gb_per_s:.1f} GB/s: a sum over the same bytes read as fp32 words. Weights read per "
        "step: "
        + ", ".join(f"{r} {b / MB:.1f} MB" for r, b in weights.items())
        + " (every parameter except the embedding table, which is only gathered)."
    )
    session.spec_note(section, engine)
    session.repeat_note(section)
    session.report.sections.append(section)
    return session.report


# -------------------------------------------------------------------------
# W2 throughput, and engine overhead at 64 decoding sequences
# -------------------------------------------------------------------------


# the engine without --batch-invariant, beside an engine run with it
DEFAULT_KERNELS = "engine, default kernels"


def run_throughput(options: BenchOptions) -> Report:
    session = Session("throughput", options)
    workload = throughput_workload(session.vocab_size, scale=options.scale)
    decode = decode_workload(session.vocab_size, scale=options.scale)
    bandwidth = measure_matvec_bandwidth(dtype=getattr(torch, options.dtype))

    engine = session.engine()
    w2 = session.median_run("w2", ENGINE, lambda: engine.run(workload.requests, ALL_AT_ONCE), engine.reset_prefix_cache)
    w2_model_seconds = sum(s.model_seconds for s in w2.steps)
    kv_read = decode_kv_read_bytes([(r.prompt_len, r.output_len) for r in workload.requests], engine.kv_layers())
    weights = engine.weight_bytes()
    decode_run = engine.run(decode.requests, ALL_AT_ONCE, time_attention=True)
    labels = engine.timed_labels()
    breakdown = decode_breakdown(decode_run.steps, len(decode.requests), labels)
    engine.close()
    walls = {ENGINE: w2.wall}
    if options.engine_settings.get("batch_invariant"):  # its cost: the same run on the default kernels
        described = session.report.setup["engine"]
        reference = session.engine_runner(DEFAULT_KERNELS, batch_invariant=False)
        session.report.setup["engine"] = described + ", --batch-invariant"
        session.report.setup[DEFAULT_KERNELS] = "the same engine without --batch-invariant, same requests"
        session.report.runners.insert(1, DEFAULT_KERNELS)
        walls[DEFAULT_KERNELS] = session.median_run(
            "w2", DEFAULT_KERNELS, lambda: reference.run(workload.requests, ALL_AT_ONCE), reference.reset_prefix_cache
        ).wall
        reference.close()
    peer_runs, _ = session.peer_runs("w2", workload)
    walls.update({name: peer_run.wall for name, peer_run in peer_runs.items()})

    section = Section("w2", workload.name, workload.description)
    out_tokens, all_tokens = workload.num_output_tokens, workload.num_prompt_tokens + workload.num_output_tokens
    section.add(
        "output_tok_s",
        "output tokens/s",
        "tok/s",
        {r: tokens_per_s(out_tokens, w) for r, w in walls.items()},
        f"the workload's {out_tokens} stated output tokens / wall seconds.",
    )
    section.add(
        "total_tok_s",
        "total tokens/s",
        "tok/s",
        {r: tokens_per_s(all_tokens, w) for r, w in walls.items()},
        f"({workload.num_prompt_tokens} prompt + {out_tokens} output tokens) / wall seconds.",
    )
    section.add(
        "wall_s",
        "wall time",
        "s",
        {r: w for r, w in walls.items()},
        peer_methods(
            "engine: all requests added, then step() until the last finished",
            {
                "hf": f"static batches of {HF_BATCH_SIZE} in order, left-padded with an attention mask, each "
                "generating max(output_len) of its members (tokens past a request's own length are computed "
                "but not counted)",
                "vllm": "all requests added to LLMEngine, then step() until the last finished",
                "llamacpp": "each prompt prefilled by its own llama_decode, then one llama_batch per step "
                "with a token of every unfinished sequence (its own seq_id) until the last finished",
            },
            session.peers,
        ),
        ".2f",
    )
    section.add(
        "model_share",
        "model time share of wall",
        "%",
        {ENGINE: w2_model_seconds / w2.wall},
        f"forward + logits phase time (the model's compute) over all {len(w2.steps)} steps / wall.",
    )
    prefill_steps = [s for s in w2.steps if not s.all_decode]
    section.add(
        "prefill_steps_s",
        "time in steps with prompt tokens",
        "s",
        {ENGINE: sum(s.seconds for s in prefill_steps)},
        f"step() time of the {len(prefill_steps)} steps that computed prompt tokens (alone or with decodes); "
        f"the other {len(w2.steps) - len(prefill_steps)} steps only decoded.",
        ".2f",
    )
    # what the decode-only steps cannot go below on this machine: their memory traffic at the
    # streaming-read bandwidth, the KV every decode forward attends over and the weights each step
    decode_steps = [s for s in w2.steps if s.all_decode]
    decode_seconds = sum(s.seconds for s in decode_steps)
    floor = weight_read_seconds(kv_read + weights * len(decode_steps), bandwidth.read_gb_per_s)
    section.add(
        "kv_read_gb",
        "KV read by decode attention",
        "GB",
        {ENGINE: kv_read / 1e9},
        "for every output token after a request's first: its context (prompt + tokens so far) x the KV bytes "
        "a token holds in all attention layers, as this engine caches it; no request shares a prefix, so any "
        "engine keeping this KV dtype reads as much.",
    )
    section.add(
        "decode_floor_s",
        "memory floor of the decode-only steps",
        "s",
        {ENGINE: floor},
        f"(KV read above + weight bytes x {len(decode_steps)} decode-only steps) / the memory read bandwidth "
        "measured in this run (note below): the time these steps take if they did nothing but stream that "
        "memory once.",
        ".2f",
    )
    section.add(
        "decode_over_floor",
        "decode-only steps / their memory floor",
        "x",
        {ENGINE: ratio(decode_seconds, floor)},
        f"step() time of the {len(decode_steps)} decode-only steps ({decode_seconds:.2f} s) / the floor above.",
        ".2f",
    )
    section.facts = {"read_gb_per_s": bandwidth.read_gb_per_s, "kv_read_bytes": kv_read, "weight_bytes": weights}
    section.notes.append(
        f"Memory read bandwidth {bandwidth.read_gb_per_s:.1f} GB/s: a sum over {bandwidth.num_bytes / MB:.0f} MB "
        f"read as fp32 words, median of {bandwidth.reps}. Weights read per step: {weights / MB:.1f} MB (every "
        "parameter except the embedding table, which is only gathered)."
    )
    session.spec_note(section, engine)
    session.repeat_note(section)
    session.report.sections.append(section)
    session.report.sections.append(overhead_section(decode.name, decode.description, breakdown, labels))
    return session.report


# the step phases outside the model, in step order, and what each does
def run_prefix(options: BenchOptions) -> Report:
    session = Session("prefix", options)
    workload = prefix_workload(session.vocab_size, scale=options.scale)

    engine = session.engine()
    run = session.median_run(
        "w3", ENGINE, lambda: engine.run(workload.requests, SEQUENTIAL, time_attention=True), engine.reset_prefix_cache
    )
    first_prefill = until_first_token(run.steps)
    snapshots = engine.state_snapshots()
    engine.close()
    runs = {ENGINE: (run.timings, run.wall)}
    peer = session.hf()
    if peer is not None:
        peer_run = session.median_run("w3", peer.name, lambda: peer.run_sequential(workload.requests))
        runs[peer.name] = (peer_run.timings, peer_run.wall)

    figures = {r: prefix_figures(timings) for r, (timings, _) in runs.items()}
    n = len(workload.requests)
    section = Section("w3", workload.name, workload.description)
    section.add(
        "ttft_first_ms",
        "time to first token, request 1",
        "ms",
        {r: f.first_ttft * 1e3 for r, f in figures.items()},
        "submit -> token 1 of the first request (engine: add_request -> end of its step(); hf: generate() "
        "call -> streamer stamp); it computes the whole prompt.",
    )
    section.add(
        "ttft_rest_ms",
        f"mean time to first token, requests 2..{n}",
        "ms",
        {r: f.rest_mean_ttft * 1e3 for r, f in figures.items()},
        "the same for each later request, averaged; these can reuse the shared prefix if the runner caches "
        "it (HF generate recomputes it).",
    )
    section.add(
        "ttft_ratio",
        f"TTFT 2..{n} / TTFT 1",
        "x",
        {r: f.rest_over_first for r, f in figures.items()},
        "row 2 / row 1: below 1 the shared prefix is served from cache.",
        ".2f",
    )
    section.add(
        "wall_s",
        "wall time",
        "s",
        {r: wall for r, (_, wall) in runs.items()},
        "first submit -> last request finished, requests one after another.",
        ".2f",
    )
    section.add(
        "first_prefill_model_ms",
        "request 1 prefill: model time",
        "ms",
        {ENGINE: sum(s.model_seconds for s in first_prefill) * 1e3},
        f"forward + logits phase time in the {len(first_prefill)} step(s) up to request 1's first token.",
    )
    if any(ATTENTION in s.timed for s in first_prefill):
        section.add(
            "first_prefill_attention_ms",
            "  of which attention layers",
            "ms",
            {ENGINE: sum(s.timed.get(ATTENTION, 0.0) for s in first_prefill) * 1e3},
            "time in the Attention layers' forward (forward hooks) in the same step(s).",
        )
    if snapshots is not None:
        held, row_bytes = snapshots
        section.add(
            "state_snapshots_mib",
            "recurrent-state snapshots held",
            "MiB",
            {ENGINE: held * row_bytes / 2**20},
            f"after the last run: {held} snapshots of {row_bytes / 2**20:.2f} MiB (every "
            f"{engine.config.state_snapshot_interval} tokens and at each prompt's last full block).",
            ".1f",
        )
    session.spec_note(section, engine)
    session.repeat_note(section)
    session.report.sections.append(section)
    return session.report


# -------------------------------------------------------------------------
# speculative decoding: the repetition workload with and without drafts
# -------------------------------------------------------------------------

NO_SPECULATION = "no speculation"


def run_spec(options: BenchOptions) -> Report:
    """The engine with speculative decoding (``--speculative-method``, default ngram) against
    itself without, on the same model and requests, one after the other in this run."""
    if options.peers:
        raise ValueError("engine bench spec compares the engine with itself; it runs no --peers.")
    session = Session("spec", options)
    session.report.runners = [ENGINE, NO_SPECULATION]
    workload = repetition_workload(session.vocab_size, scale=options.scale)
    method = options.engine_settings.get("speculative_method") or "ngram"
    section = Section("spec", workload.name, workload.description)
    runs = {}
    for runner, speculative in ((NO_SPECULATION, None), (ENGINE, method)):
        engine = session.engine_runner(runner, speculative_method=speculative)
        runs[runner] = session.median_run(
            "spec", runner, lambda engine=engine: engine.run(workload.requests, SEQUENTIAL), engine.reset_prefix_cache
        )
        if speculative is not None:
            session.spec_note(section, engine)
        engine.close()
    section.add(
        "decode_tok_s",
        "decode tokens/s",
        "tok/s",
        {r: sum(map(decode_tokens_per_s, run.timings)) / len(run.timings) for r, run in runs.items()},
        f"(N - 1) / (t_N - t_1) of each request, averaged over the {len(workload.requests)} requests; "
        f"engine: with --speculative-method {method}, {NO_SPECULATION}: the same engine settings without it.",
    )
    section.add(
        "ttft_ms",
        "mean time to first token",
        "ms",
        {r: sum(t.ttft for t in run.timings) / len(run.timings) * 1e3 for r, run in runs.items()},
        "add_request -> end of the step() that returned token 1, averaged.",
    )
    section.add(
        "wall_s",
        "wall time",
        "s",
        {r: run.wall for r, run in runs.items()},
        "first submit -> last request finished.",
        ".2f",
    )
    session.repeat_note(section)
    session.report.sections.append(section)
    return session.report


# W3's prompts (1088 tokens) do not fit vLLM's max_model_len of 1024
PROCESS_PEER_COMMANDS = ("latency", "throughput")

COMMANDS: dict[str, Callable[[BenchOptions], Report]] = {
    "latency": run_latency,
    "throughput": run_throughput,
    "prefix": run_prefix,
    "spec": run_spec,
}


def run_bench(command: str, options: BenchOptions) -> Report:
    if command not in COMMANDS:
        raise ValueError(f"Unknown bench workload {command!r}. Available: {', '.join(COMMANDS)}.")
    process_peers = [p for p in options.peers if p in PROCESS_PEERS]
    if process_peers and command not in PROCESS_PEER_COMMANDS:
        raise ValueError(
            f"--peers {','.join(process_peers)}: these peers run engine bench {' and '.join(PROCESS_PEER_COMMANDS)} "
            f"only, not {command}."
        )
    report = COMMANDS[command](options)
    report.setup["machine"] += (
        f", {os.getloadavg()[0]:.2f} at end (this run adds about 1-2; more means other work shared the CPUs "
        "and skewed every figure)"
    )
    return report


# -------------------------------------------------------------------------
# structured output: W2 with a JSON schema per request
# -------------------------------------------------------------------------

STRUCTURED_BACKENDS = ("xgrammar", "llguidance")


def structured_schema(i: int) -> dict:
    """Request ``i``'s schema: ten fields (nested object, array, enum, pattern, bounded
    numbers, an optional one); ``i`` goes into its description, so that every request's
    schema is compiled anew."""
    return {
        "type": "object",
        "description": f"record {i}",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 1000000},
            "name": {"type": "string", "maxLength": 24},
            "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,8}\\.(com|org)$"},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "score": {"type": "number", "minimum": 0, "maximum": 100},
            "active": {"type": "boolean"},
            "status": {"enum": ["new", "open", "closed"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 4},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 20},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
            "note": {"type": "string", "maxLength": 40},
        },
        "required": ["id", "name", "email", "age", "score", "active", "status", "tags", "address"],
        "additionalProperties": False,
    }


def _demo_tokenizer() -> str:
    from pathlib import Path

    import engine

    return str(Path(engine.__file__).parent / "demo_model")


def run_structured(options: BenchOptions) -> Report:
    """W2's requests unconstrained, then each with a JSON schema on every installed backend."""
    from engine.plugins.manager import get_plugin_manager
    from engine.sampling_params import StructuredOutputsParams

    settings = dict(options.engine_settings)
    registry = get_plugin_manager(settings.get("plugins")).components().structured_output_backends
    backends = [name for name in STRUCTURED_BACKENDS if name in registry]
    if not backends:
        raise ValueError("engine bench structured needs a structured-output backend: pip install engine-xgrammar.")
    options = BenchOptions(
        model=options.model,
        dtype=options.dtype,
        scale=options.scale,
        repeat=options.repeat,
        engine_settings={"tokenizer": _demo_tokenizer(), **settings},
    )
    session = Session("structured", options)
    session.report.runners = [ENGINE, *backends]
    workload = throughput_workload(session.vocab_size, scale=options.scale)
    # compact JSON: a random model would otherwise fill the output with the whitespace JSON allows
    constraints = [
        StructuredOutputsParams(json=structured_schema(i), disable_any_whitespace=True)
        for i in range(len(workload.requests))
    ]

    engine = session.engine()
    base = session.median_run(
        "structured", ENGINE, lambda: engine.run(workload.requests, ALL_AT_ONCE), engine.reset_prefix_cache
    )
    engine.close()
    runs = {ENGINE: base}
    compiles: dict[str, list[float]] = {}
    finished_by: dict[str, dict[str, int]] = {}
    for backend in backends:
        runner = session.engine_runner(backend, structured_output_backend=backend)
        compiles[backend] = runner.precompile(constraints)
        runs[backend] = session.median_run(
            "structured",
            backend,
            lambda runner=runner: runner.run(workload.requests, ALL_AT_ONCE, constraints),
            runner.reset_prefix_cache,
        )
        finished_by[backend] = runner.last_finish_reasons
        runner.close()

    section = Section("structured", f"{workload.name}, each request with a JSON schema", workload.description)
    produced = {name: sum(t.output_len for t in run.timings) for name, run in runs.items()}
    throughput = {name: tokens_per_s(produced[name], run.wall) for name, run in runs.items()}
    section.add(
        "output_tok_s",
        "output tokens/s",
        "tok/s",
        throughput,
        "output tokens produced / wall seconds (engine: unconstrained, exactly the stated lengths; a backend: "
        "the same requests, each constrained to its schema, ending when its JSON is complete or at its length).",
    )
    section.add(
        "vs_unconstrained",
        "constrained / unconstrained throughput",
        "x",
        {name: ratio(throughput[name], throughput[ENGINE]) for name in backends},
        "the backend's output tokens/s over the engine's unconstrained output tokens/s in this run.",
        ".3f",
    )
    section.add(
        "output_tokens",
        "output tokens produced",
        "tokens",
        produced,
        "the sum over the requests (finish reasons in the notes).",
        ".0f",
    )
    section.add(
        "compile_ms",
        "mean schema compile time",
        "ms",
        {name: sum(s) / len(s) * 1e3 for name, s in compiles.items()},
        f"each of the {len(constraints)} distinct schemas compiled once before the run (as the server does "
        "before a request reaches the engine loop), outside the timed wall.",
        ".2f",
    )
    section.add(
        "wall_s",
        "wall time",
        "s",
        {name: run.wall for name, run in runs.items()},
        "all requests added, then step() until the last finished.",
        ".2f",
    )
    for backend in backends:
        reasons = ", ".join(f"{n} {reason}" for reason, n in sorted(finished_by[backend].items()))
        section.notes.append(f"{backend}: requests finished with {reasons}.")
    section.notes.append(
        "The model has random weights and no tokenizer of its own: the engine's demo tokenizer (4096 tokens) "
        "gives the constraints their vocabulary; logits of ids beyond it are always masked. The JSON is compact "
        "(disable_any_whitespace): with whitespace allowed, a random model writes little else."
    )
    session.repeat_note(section)
    session.report.sections.append(section)
    return session.report


COMMANDS["structured"] = run_structured
