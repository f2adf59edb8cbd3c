"""``engine bench`` on a checkpoint of one's own (``--checkpoint``): quantized while loading
(``--quantization``), prequantized (``engine quantize``), or a GGUF file; which peers run
it, how a peer that cannot is reported, and the weights line of every engine run. The
vllm and llamacpp peers are stand-ins (a Python with an empty package of the peer's name
and a worker script that speaks the bench's protocol), as in tests/bench/test_process_peers.py."""

from __future__ import annotations

import importlib.util
import json
import sys
import textwrap
from pathlib import Path

import pytest

from engine import LLM
from engine.bench import process_peers
from engine.bench.checkpoint import BenchCheckpoint
from engine.bench.process_peers import LlamaCppPeer, VllmPeer, checkpoint_weight_bytes
from engine.bench.session import BenchOptions, Session
from engine.cli import main
from engine.testing.checkpoints import make_tiny_checkpoint

PLUGINS = "cpu,llama,gptq"
GPTQ = {"bits": 4, "group_size": 32}
WORKERS = Path(process_peers.__file__).parent / "peer_workers"

# a worker that speaks the protocol: request i's tokens 1 ms apart, 10 ms after its submission
PROTOCOL_WORKER = """
runs = []
for r in range(job["repeat"]):
    stamps = []
    for i, request in enumerate(job["requests"]):
        start = 100.0 * r + i
        stamps.append({"submitted": start, "token_times": [start + 0.010 + 0.001 * k for k in range(request["output_len"])]})
    runs.append({"wall": 2.0 + r, "requests": stamps})
_protocol.write_result(result_path, {"vllm": "0.0-stand-in", "llama_cpp_python": "0.0-stand-in", "torch": "t",
    "python": "p"}, {"executor": "uni", "n_threads": job["threads"], "gguf": job["settings"].get("gguf", "")}, runs)
"""
# a worker that fails as vLLM does on a quantization it has no kernels for
GPTQ_REFUSING_WORKER = """
print("INFO loading", job["model"], file=sys.stderr)
print("Traceback (most recent call last):", file=sys.stderr)
print("pydantic_core.ValidationError: 1 validation error for ModelConfig", file=sys.stderr)
print("  Value error, gptq quantization is not supported on CPU here", file=sys.stderr)
sys.exit(1)
"""


def stand_in_python(folder: Path, *modules: str) -> str:
    """An executable running this Python without site-packages, with an empty package for each of ``modules``."""
    site = folder / "site"
    for module in modules:
        (site / module).mkdir(parents=True, exist_ok=True)
        (site / module / "__init__.py").write_text("")
    python = folder / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH="{site}" exec "{sys.executable}" -S "$@"\n')
    python.chmod(0o755)
    return str(python)


def stand_in_worker(folder: Path, body: str) -> Path:
    script = folder / "worker.py"
    script.write_text(
        f"import json, os, sys\nsys.path.insert(0, {str(WORKERS)!r})\nimport _protocol\n"
        "job = _protocol.read_job(sys.argv[1])\nresult_path = sys.argv[2]\n" + textwrap.dedent(body)
    )
    return script


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(a float32 tiny Llama, its GPTQ copy written by engine quantize)."""
    root = tmp_path_factory.mktemp("bench-quantized")
    make_tiny_checkpoint("LlamaForCausalLM", root / "tiny-llama")
    argv = ["quantize", str(root / "tiny-llama"), str(root / "gptq"), "--quantization", "gptq"]
    assert main([*argv, "--quantization-config", json.dumps(GPTQ), "--plugins", PLUGINS, "--no-progress"]) == 0
    return root / "tiny-llama", root / "gptq"


def bench_json(capsys, *args: str) -> dict:
    argv = ["bench", *args, "--scale", "0.05", "--dtype", "float32", "--plugins", PLUGINS, "--json"]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def logged_weights(path, **kwargs) -> str:
    """What the engine logs of the weights it loaded, less ``weights: ``."""
    llm = LLM(str(path), plugins=PLUGINS.split(","), dtype="float32", progress=False, kv_cache_memory=0.01, **kwargs)
    return llm.engine.model.weight_memory.describe().removeprefix("weights: ")


def test_quantizing_while_loading_reports_the_engines_weights_and_the_peers_dense_run(capsys, checkpoints):
    dense, _ = checkpoints
    report = bench_json(
        capsys,
        "latency",
        "--checkpoint",
        str(dense),
        "--quantization",
        "gptq",
        "--quantization-config",
        json.dumps(GPTQ),
        "--peers",
        "hf",
    )
    assert report["runners"] == ["engine", "hf"]
    assert report["setup"]["weights"] == logged_weights(dense, quantization="gptq", quantization_config=GPTQ)
    # symmetric 4-bit groups of 32: 4 bits and a float32 scale a group (the zero stands for the offsets), 5/32
    assert "in 8 quantized linear layers, 15.6% of their float32 size" in report["setup"]["weights"]
    assert "quantization gptq" in report["setup"]["engine"]
    assert any("the peers run its unquantized weights in float32" in note for note in report["notes"])
    figures = report["sections"]["w1"]["figures"]
    assert figures["decode_tok_s"]["values"]["engine"] > 0 and figures["decode_tok_s"]["values"]["hf"] > 0
    weights = report["sections"]["w1"]["facts"]["weight_bytes"]
    assert weights["engine"] < 0.5 * weights["hf"]  # 4-bit layers beside the dense model's


def test_a_prequantized_checkpoint_runs_on_the_engine_and_each_peer_that_can(
    capsys, checkpoints, tmp_path, monkeypatch
):
    _, gptq = checkpoints
    python = stand_in_python(tmp_path, "vllm", "llama_cpp")
    monkeypatch.setattr(VllmPeer, "script", stand_in_worker(tmp_path, GPTQ_REFUSING_WORKER))
    peers = ["--peers", "vllm,hf,llamacpp", "--peer-python", python]
    report = bench_json(capsys, "throughput", "--checkpoint", str(gptq), *peers)
    setup = report["setup"]
    assert setup["model"] == (
        f"{gptq}, safetensors quantized with gptq (bits 4, group_size 32, sym True, desc_act False, "
        "checkpoint_format gptq, lm_head False)"
    )
    assert setup["weights"] == logged_weights(gptq)
    # llama.cpp is not tried: the bench exports dense checkpoints only
    assert report["runners"] == ["engine", "vllm", "hf"]
    assert setup["llamacpp"].startswith("not run: runs GGUF files, and the bench writes a GGUF of dense weights only")
    # vllm tried and failed: its row says why, its figures are dashes
    assert setup["vllm"].startswith(
        "could not run this gptq checkpoint: pydantic_core.ValidationError: 1 validation error for ModelConfig Value "
        "error, gptq quantization is not supported on CPU here (its whole output: "
    )
    wall = report["sections"]["w2"]["figures"]["wall_s"]
    assert wall["values"]["engine"] > 0 and "vllm" not in wall["values"] and wall["ratios"]["engine/vllm"] is None
    if importlib.util.find_spec("optimum") is None:  # transformers loads GPTQ through optimum
        assert setup["hf"] == (
            "could not run this gptq checkpoint: Loading a GPTQ quantized model requires optimum (`pip install optimum`)"
        )
        assert "hf" not in wall["values"]
    else:
        assert wall["values"]["hf"] > 0


def test_a_failing_peer_on_a_dense_checkpoint_stays_an_error(capsys, checkpoints, tmp_path, monkeypatch):
    dense, _ = checkpoints
    python = stand_in_python(tmp_path, "vllm")
    monkeypatch.setattr(VllmPeer, "script", stand_in_worker(tmp_path, GPTQ_REFUSING_WORKER))
    argv = ["bench", "latency", "--checkpoint", str(dense), "--peers", "vllm", "--peer-python", python]
    assert main([*argv, "--scale", "0.05", "--dtype", "float32", "--plugins", PLUGINS]) == 1
    assert "The vllm peer failed" in capsys.readouterr().err


def test_every_engine_run_gets_a_weights_line(capsys, checkpoints):
    _, gptq = checkpoints
    report = bench_json(capsys, "spec", "--checkpoint", str(gptq))
    assert report["setup"]["weights"] == report["setup"]["weights, no speculation"] == logged_weights(gptq)


def test_checkpoint_and_model_name_one_model(capsys, checkpoints):
    dense, gptq = checkpoints
    assert main(["bench", "latency", "--checkpoint", str(dense), "--model", str(gptq)]) == 1
    assert f"--checkpoint {dense} and --model {gptq} name two models; give one." in capsys.readouterr().err


def test_integer_tensors_count_as_stored_in_the_vllm_weight_bytes(checkpoints):
    """float tensors in the compute dtype, the packed GPTQ words and indices as they are."""
    from safetensors.torch import load_file

    _, gptq = checkpoints
    tensors = load_file(gptq / "model.safetensors")
    expected = sum(
        t.numel() * (t.element_size() if not t.is_floating_point() else 2)
        for name, t in tensors.items()
        if name != "model.embed_tokens.weight"
    )
    assert checkpoint_weight_bytes(gptq, "bfloat16") == expected


@pytest.fixture(scope="module")
def gguf_file(checkpoints):
    pytest.importorskip("gguf", reason="gguf is in engine's test extras")
    from engine.bench.gguf_export import cached_gguf

    return cached_gguf(checkpoints[0], "bfloat16")


def test_a_gguf_checkpoint_runs_on_llamacpp_as_it_is_and_not_on_hf_or_vllm(gguf_file, tmp_path, monkeypatch):
    from engine.bench.gguf_export import gguf_weight_bytes

    checkpoint = BenchCheckpoint.resolve(str(gguf_file))
    assert checkpoint.is_gguf and checkpoint.vocab_size == 320 and checkpoint.quant_method == "gguf"
    python = stand_in_python(tmp_path, "vllm", "llama_cpp")
    options = BenchOptions(model=str(gguf_file), dtype="float32", peers=("hf", "vllm", "llamacpp"), peer_python=python)
    session = Session("latency", options)  # no engine is loaded until a workload runs
    assert session.peers == ("llamacpp",) and session.report.runners == ["engine", "llamacpp"]
    refusal = f"not run: runs safetensors checkpoint directories; {gguf_file.name} is a GGUF file"
    assert session.report.setup["hf"] == session.report.setup["vllm"] == refusal

    peer = session.process_peers["llamacpp"]
    assert peer.gguf() == gguf_file.resolve()  # the file itself, nothing exported
    assert peer.weight_bytes() == gguf_weight_bytes(gguf_file)
    monkeypatch.setattr(LlamaCppPeer, "script", stand_in_worker(tmp_path, PROTOCOL_WORKER))
    from engine.bench.workloads import latency_workload

    runs = peer.runs(latency_workload(320, scale=0.05), session.warmup, 1)
    assert len(runs) == 1 and runs[0].wall == 2.0
    described = peer.describe()
    assert f"GGUF {gguf_file.name} (the --checkpoint file, tensors " in described and "BF16 x " in described
