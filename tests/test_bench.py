"""``engine bench``: the workload lists against benchmarks/README.md, the arithmetic of every
figure on hand-computed inputs, the timers, and each subcommand end to end on a
tiny checkpoint (``--scale 0.05``). No timing is asserted."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import torch

from engine.bench.engine_runner import FORWARD, LOGITS, StepRecord, decode_breakdown
from engine.bench.metrics import (
    RequestTiming,
    bandwidth_gb_per_s,
    decode_kv_read_bytes,
    decode_step_seconds,
    decode_tokens_per_s,
    overhead_share,
    prefix_figures,
    ratio,
    tokens_per_s,
    weight_read_seconds,
)
from engine.bench.report import Report, Section
from engine.bench.roofline import weight_bytes
from engine.bench.workloads import (
    ALL_AT_ONCE,
    SEQUENTIAL,
    decode_workload,
    latency_workload,
    max_token_id,
    prefix_workload,
    scaled,
    throughput_workload,
    warmup_request,
)
from engine.cli import main

# -------------------------------------------------------------------------
# workloads, against the facts of benchmarks/README.md
# -------------------------------------------------------------------------


def test_w1_is_one_request_of_128_plus_128():
    w = latency_workload()
    assert len(w.requests) == 1 and w.submission == SEQUENTIAL
    (r,) = w.requests
    assert r.prompt_len == 128 and r.output_len == 128
    assert all(0 <= t <= 31999 for t in r.prompt_token_ids)
    assert latency_workload() == w


def test_w2_draws_all_lengths_first_then_ids_from_random_0():
    # reference written from benchmarks/README.md's sentence, independently of the generator
    rng = random.Random(0)
    pairs = [(rng.randint(32, 512), rng.randint(16, 256)) for _ in range(64)]
    expected = [([rng.randint(0, 31999) for _ in range(p)], o) for p, o in pairs]

    w = throughput_workload()
    assert w.submission == ALL_AT_ONCE and len(w.requests) == 64
    assert [(list(r.prompt_token_ids), r.output_len) for r in w.requests] == expected
    assert all(32 <= r.prompt_len <= 512 and 16 <= r.output_len <= 256 for r in w.requests)
    assert w.num_output_tokens == sum(o for _, o in pairs)
    assert throughput_workload() == w


def test_w2_lengths_do_not_depend_on_the_vocabulary_and_ids_fit_it():
    big, small = throughput_workload(32000), throughput_workload(320)
    assert [(r.prompt_len, r.output_len) for r in big.requests] == [
        (r.prompt_len, r.output_len) for r in small.requests
    ]
    assert max(max(r.prompt_token_ids) for r in small.requests) <= 319
    assert max(max(r.prompt_token_ids) for r in big.requests) > 319


def test_w3_shares_a_1024_prefix_and_differs_in_64_token_suffixes():
    w = prefix_workload()
    assert len(w.requests) == 32 and w.submission == SEQUENTIAL
    prefix = w.requests[0].prompt_token_ids[:1024]
    suffixes = set()
    for r in w.requests:
        assert r.prompt_len == 1024 + 64 and r.output_len == 64
        assert r.prompt_token_ids[:1024] == prefix
        suffixes.add(r.prompt_token_ids[1024:])
    assert len(suffixes) == 32
    assert prefix_workload() == w


def test_decode_workload_is_64_sequences_of_32_plus_64():
    w = decode_workload()
    assert w.submission == ALL_AT_ONCE
    assert [(r.prompt_len, r.output_len) for r in w.requests] == [(32, 64)] * 64


def test_lists_do_not_share_a_prefix_with_each_other_or_the_warm_up():
    firsts = {
        latency_workload().requests[0].prompt_token_ids[:8],
        prefix_workload().requests[0].prompt_token_ids[:8],
        decode_workload().requests[0].prompt_token_ids[:8],
        warmup_request().prompt_token_ids,
    }
    assert len(firsts) == 4


def test_token_id_bound_and_scaling():
    assert max_token_id(32000) == 31999 and max_token_id(320) == 319 and max_token_id(50000) == 31999
    with pytest.raises(ValueError):
        max_token_id(0)
    assert scaled(64, 1.0) == 64 and scaled(64, 0.05) == 3 and scaled(16, 0.01) == 1 and scaled(128, 0.001, 2) == 2
    with pytest.raises(ValueError, match="scale must be positive"):
        scaled(64, 0)
    small = prefix_workload(320, scale=0.05)
    assert len(small.requests) == 2 and small.requests[0].prompt_len == 51 + 3 and small.requests[0].output_len == 3
    assert latency_workload(scale=0.01).requests[0].output_len == 2  # a decode rate needs two tokens


# -------------------------------------------------------------------------
# arithmetic, on hand-computed cases
# -------------------------------------------------------------------------


def test_request_timing_figures():
    t = RequestTiming(submitted=10.0, first_token=10.5, finished=12.5, prompt_len=128, output_len=5)
    assert t.ttft == pytest.approx(0.5)
    assert decode_tokens_per_s(t) == pytest.approx(4 / 2.0)  # 4 tokens after the first, in 2 s
    assert decode_step_seconds(t) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="at least 2"):
        decode_tokens_per_s(RequestTiming(0, 1, 1, 4, 1))


def test_rates_ratios_and_overhead():
    assert tokens_per_s(9800, 60.0) == pytest.approx(163.333, rel=1e-4)
    assert ratio(300.0, 150.0) == 2.0
    assert ratio(None, 1.0) is None and ratio(1.0, None) is None and ratio(1.0, 0.0) is None
    assert overhead_share(0.010, 0.004) == pytest.approx(0.6)
    assert overhead_share(0.010, 0.010) == 0.0
    # a [8192, 8192] bf16 matrix is 134,217,728 bytes; read in 6.1 ms that is 22.0 GB/s
    assert bandwidth_gb_per_s(8192 * 8192 * 2, 0.0061) == pytest.approx(22.003, rel=1e-4)
    # 84 MB of weights at 21 GB/s take 4 ms
    assert weight_read_seconds(84_000_000, 21.0) == pytest.approx(0.004)


def test_decode_kv_read_counts_each_decode_forwards_context_per_layer():
    # prompt 3, 3 outputs: the forwards of tokens 1 and 2 attend over 4 and 5 positions; a
    # layer of 10 bytes a token reads 10 * (4 + 5), one of 4 bytes with a window of 4 reads 4 * (4 + 4)
    assert decode_kv_read_bytes([(3, 3)], [(10, None), (4, 4)]) == 90 + 32
    assert decode_kv_read_bytes([(5, 1)], [(10, None)]) == 0  # the only token comes from the prefill
    assert decode_kv_read_bytes([(3, 3), (1, 2)], [(10, None)]) == 90 + 20
    with pytest.raises(ValueError, match="needs a prompt"):
        decode_kv_read_bytes([(0, 4)], [(10, None)])


def test_prefix_figures():
    timings = [RequestTiming(0.0, ttft, 1.0, 1088, 64) for ttft in (1.0, 0.2, 0.4)]
    f = prefix_figures(timings)
    assert (f.first_ttft, f.rest_mean_ttft, f.rest_over_first) == pytest.approx((1.0, 0.3, 0.3))
    with pytest.raises(ValueError):
        prefix_figures(timings[:1])


def _step(seconds, forward, tokens, sampled, all_decode, **parts):
    (forward_tokens,) = tokens  # one forward per step
    return StepRecord(seconds, {FORWARD: forward, **parts}, forward_tokens, sampled, all_decode)


def test_decode_breakdown_counts_only_all_decode_steps_of_the_batch_size():
    steps = [
        _step(0.500, 0.450, [2048], 64, False),  # prefill
        _step(0.100, 0.050, [64], 64, True, attention=0.020, logits=0.010),
        _step(0.120, 0.070, [64], 64, True, attention=0.040, logits=0.010),
        _step(0.050, 0.040, [63], 63, True),  # fewer sequences
    ]
    b = decode_breakdown(steps, 64, [FORWARD, LOGITS, "attention", "schedule"])
    assert b.num_steps == 2
    assert b.step_seconds == pytest.approx(0.110) and b.model_seconds == pytest.approx(0.070)  # forward + logits
    assert b.overhead_seconds == pytest.approx(0.040) and b.overhead_share == pytest.approx(0.040 / 0.110)
    assert b.parts == pytest.approx({"logits": 0.010, "attention": 0.030, "schedule": 0.0})
    assert decode_breakdown(steps, 32, [FORWARD]) is None
    # a run without the attention timer has no attention part (not a zero one)
    untimed = decode_breakdown(steps[3:], 63, [FORWARD, LOGITS, "attention"])
    assert untimed is not None and untimed.parts == pytest.approx({"logits": 0.0})


def test_weight_bytes_skips_the_gathered_embedding_unless_tied():
    class Tiny(torch.nn.Module):
        def __init__(self, tie: bool) -> None:
            super().__init__()
            self.embed_tokens = torch.nn.Embedding(100, 8, dtype=torch.bfloat16)
            self.proj = torch.nn.Linear(8, 8, bias=True, dtype=torch.bfloat16)
            self.lm_head = torch.nn.Linear(8, 100, bias=False, dtype=torch.bfloat16)
            if tie:
                self.lm_head.weight = self.embed_tokens.weight

    assert weight_bytes(Tiny(tie=False)) == (8 * 8 + 8 + 100 * 8) * 2
    assert weight_bytes(Tiny(tie=True)) == (8 * 8 + 8 + 100 * 8) * 2  # the head reads the shared table once


# -------------------------------------------------------------------------
# timers and report
# -------------------------------------------------------------------------


def test_report_ratios_are_engine_over_peer_and_missing_values_print_as_dashes():
    section = Section("w", "W", "test")
    section.add("rate", "rate", "tok/s", {"engine": 300.0, "hf": 150.0}, "how")
    section.add("share", "share", "%", {"engine": 0.25}, "how")
    report = Report("latency", ["engine", "hf"], {"model": "m"}, [section])
    figures = report.as_dict()["sections"]["w"]["figures"]
    assert figures["rate"]["ratios"] == {"engine/hf": 2.0}
    assert figures["share"]["ratios"] == {"engine/hf": None}
    text = report.as_text()
    assert "2.00" in text and "25.0%" in text and "[2] how" in text


# -------------------------------------------------------------------------
# end to end on a tiny checkpoint
# -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from engine.testing.checkpoints import make_tiny_checkpoint

    path = tmp_path_factory.mktemp("bench") / "tiny-llama"
    make_tiny_checkpoint("LlamaForCausalLM", path)  # vocab 320: ids are drawn below it
    return str(path)


def run_bench_json(capsys, *args: str) -> dict:
    assert main(["bench", *args, "--scale", "0.05", "--dtype", "float32", "--plugins", "cpu,llama", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


EXPECTED_FIGURES = {
    "latency": {
        "w1": [
            "ttft_ms",
            "decode_tok_s",
            "decode_step_ms",
            "weight_read_ms",
            "step_over_weight_read",
            "weight_stream_ms",
            "step_over_weight_stream",
        ]
    },
    "throughput": {"w2": ["output_tok_s", "total_tok_s", "wall_s"]},
    "prefix": {"w3": ["ttft_first_ms", "ttft_rest_ms", "ttft_ratio", "wall_s"]},
}


@pytest.mark.parametrize("workload", list(EXPECTED_FIGURES))
def test_bench_with_hf_peer_prints_json_with_both_runners_and_ratios(capsys, tiny_llama, workload):
    report = run_bench_json(capsys, workload, "--model", tiny_llama, "--peers", "hf")
    assert report["command"] == workload and report["runners"] == ["engine", "hf"]
    for section, keys in EXPECTED_FIGURES[workload].items():
        figures = report["sections"][section]["figures"]
        for key in keys:
            values = figures[key]["values"]
            assert values["engine"] > 0 and values["hf"] > 0, (key, values)
            assert figures[key]["ratios"]["engine/hf"] == pytest.approx(values["engine"] / values["hf"])
            assert figures[key]["method"]


def test_throughput_reports_engine_overhead_at_all_decoding_sequences(capsys, tiny_llama):
    report = run_bench_json(capsys, "throughput", "--model", tiny_llama)
    w2 = {k: f["values"]["engine"] for k, f in report["sections"]["w2"]["figures"].items()}
    assert 0 < w2["prefill_steps_s"] <= w2["wall_s"]
    # the KV the decode forwards read, from the checkpoint's config and the workload's lengths:
    # K and V of every kv head in every layer, fp32, over prompt + j positions for token j >= 1
    config = json.loads((Path(tiny_llama) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * 4
    workload = throughput_workload(config["vocab_size"], scale=0.05)
    contexts = sum(r.prompt_len + j for r in workload.requests for j in range(1, r.output_len))
    assert w2["kv_read_gb"] == pytest.approx(contexts * per_token / 1e9)
    facts = report["sections"]["w2"]["facts"]
    assert facts["kv_read_bytes"] == contexts * per_token
    assert w2["decode_floor_s"] > facts["kv_read_bytes"] / (facts["read_gb_per_s"] * 1e9) > 0  # plus the weights
    assert w2["decode_over_floor"] * w2["decode_floor_s"] < w2["wall_s"]
    section = report["sections"]["decode_overhead"]
    assert section["facts"]["num_seqs"] == 3 and section["facts"]["num_steps"] == 2  # 3 output tokens: 2 decode steps
    values = {k: f["values"]["engine"] for k, f in section["figures"].items()}
    assert values["step_ms"] > values["model_ms"] > values["attention_ms"] > 0
    assert values["model_ms"] > values["logits_ms"] > 0
    assert values["overhead_ms"] == pytest.approx(values["step_ms"] - values["model_ms"])
    assert values["overhead_share"] == pytest.approx(values["overhead_ms"] / values["step_ms"])


def test_only_runs_that_time_attention_carry_the_hooks(tiny_llama):
    from engine.bench.engine_runner import ATTENTION, EngineRunner
    from engine.layers.attention import Attention

    runner = EngineRunner(tiny_llama, dtype="float32", plugins=["cpu", "llama"])
    try:
        layers = [m for m in runner.model.modules() if isinstance(m, Attention)]
        hooks = []  # the forward pre-hooks each layer carries, seen while the model runs (the spy's own included)

        def spy(module, args):
            hooks.append([len(layer._forward_pre_hooks) for layer in layers])

        handle = layers[0].register_forward_pre_hook(spy)
        requests = throughput_workload(runner.vocab_size, scale=0.05).requests[:2]
        plain = runner.run(requests, ALL_AT_ONCE)
        assert hooks and all(seen == [1] + [0] * (len(layers) - 1) for seen in hooks)
        assert all(ATTENTION not in step.timed for step in plain.steps)
        hooks.clear()
        timed = runner.run(requests, ALL_AT_ONCE, time_attention=True)
        assert hooks and all(seen == [2] + [1] * (len(layers) - 1) for seen in hooks)
        assert all(step.timed[ATTENTION] > 0 for step in timed.steps)
        handle.remove()
        assert not any(layer._forward_pre_hooks for layer in layers)  # the run removed its hooks
    finally:
        runner.close()


def test_prefix_breaks_down_the_first_prefill(capsys, tiny_llama):
    figures = run_bench_json(capsys, "prefix", "--model", tiny_llama)["sections"]["w3"]["figures"]
    model, attention = figures["first_prefill_model_ms"]["values"], figures["first_prefill_attention_ms"]["values"]
    assert model["engine"] > attention["engine"] > 0
    assert "1 step(s)" in figures["first_prefill_model_ms"]["method"]  # 54 prompt tokens fit one step


def test_latency_table_names_each_method(capsys, tiny_llama):
    assert (
        main(
            [
                "bench",
                "latency",
                "--model",
                tiny_llama,
                "--scale",
                "0.05",
                "--dtype",
                "float32",
                "--plugins",
                "cpu,llama",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "W1 latency" in out and "decode tokens/s" in out and "our overhead" in out
    assert "[1] engine: add_request" in out and "NOT the benchmark workloads" in out


def test_the_setup_shows_the_linear_kernels_the_platform_chose(capsys, tiny_llama, tmp_path, monkeypatch):
    from engine_cpu import native
    from engine_cpu.linear import onednn_available

    kernels = native.load()
    if kernels is None or not kernels.gemv_supported() or not onednn_available():
        pytest.skip("engine-cpu chooses between kernels only with gemv (AVX512-BF16) and oneDNN")
    monkeypatch.setenv("ENGINE_CPU_TUNING", "1")
    monkeypatch.setenv("ENGINE_CPU_TUNING_FILE", str(tmp_path / "tuning.json"))
    args = ["bench", "latency", "--model", tiny_llama, "--scale", "0.05", "--plugins", "cpu,llama", "--json"]
    assert main(args) == 0
    line = json.loads(capsys.readouterr().out)["setup"]["engine linear kernels"]
    assert line.startswith("OneDNNLinearMethod: ")
    # every layer shape with a kernel for each band of rows, the last open-ended: which wins is
    # the machine's to say
    kernel = "(gemv|onednn|amx)"
    band = rf"{kernel} \d+(-\d+)?"
    for part in line.removeprefix("OneDNNLinearMethod: ").split("; "):
        assert re.fullmatch(rf"\d+x\d+: ({band}, )*{kernel} \d+\+", part), part
    assert (tmp_path / "tuning.json").exists()


def test_unknown_peer_is_a_clear_error(capsys, tiny_llama):
    assert main(["bench", "latency", "--model", tiny_llama, "--peers", "sglang"]) == 1
    assert "Unknown peer(s) sglang. Available: hf, vllm, llamacpp." in capsys.readouterr().err


def test_repeat_reports_the_median_run_and_lists_every_wall(capsys, tiny_llama):
    report = run_bench_json(capsys, "prefix", "--model", tiny_llama, "--peers", "hf", "--repeat", "3")
    section = report["sections"]["w3"]
    note = next(n for n in section["notes"] if n.startswith("--repeat 3"))
    walls = {
        runner: [float(w) for w in text.split(" ", 1)[1].removesuffix(" s").split(", ")]
        for runner, text in (
            ("engine", note.split("walls: ")[1].split("; ")[0]),
            ("hf", note.split("walls: ")[1].split("; ")[1].removesuffix(".")),
        )
    }
    for runner, values in walls.items():
        assert len(values) == 3
        assert section["figures"]["wall_s"]["values"][runner] == pytest.approx(sorted(values)[1], abs=0.006)
    # every engine run began with an empty prefix cache: request 1 computed its whole prompt each time,
    # so it stays far slower than the later requests that reuse its prefix
    assert section["figures"]["ttft_ratio"]["values"]["engine"] < 1


def test_repeat_must_be_positive(capsys, tiny_llama):
    assert main(["bench", "latency", "--model", tiny_llama, "--repeat", "0"]) == 1
    assert "--repeat must be at least 1, got 0." in capsys.readouterr().err


def test_throughput_with_batch_invariant_shows_its_cost_against_the_default_kernels(capsys, tiny_llama):
    report = run_bench_json(capsys, "throughput", "--model", tiny_llama, "--batch-invariant")
    figures = report["sections"]["w2"]["figures"]
    walls = figures["wall_s"]["values"]
    assert set(walls) == {"engine", "engine, default kernels"} and all(w > 0 for w in walls.values())
    assert figures["wall_s"]["ratios"]["engine/engine, default kernels"] == pytest.approx(
        walls["engine"] / walls["engine, default kernels"]
    )
    assert "--batch-invariant" in report["setup"]["engine"]


def test_spec_compares_the_engine_with_itself_without_speculation(capsys, tiny_llama):
    """Both runs on the same requests: with ngram speculation (its counters in the facts) and without."""
    report = run_bench_json(capsys, "spec", "--model", tiny_llama, "--scale", "0.5")
    assert report["runners"] == ["engine", "no speculation"]
    section = report["sections"]["spec"]
    figures = section["figures"]
    for key in ("decode_tok_s", "ttft_ms", "wall_s"):
        values = figures[key]["values"]
        assert values["engine"] > 0 and values["no speculation"] > 0
        assert figures[key]["ratios"]["engine/no speculation"] == pytest.approx(
            values["engine"] / values["no speculation"]
        )
    # the engine's run had speculative decoding (a random model rarely repeats, so drafts may be few)
    assert set(section["facts"]["speculative"]) >= {"rounds", "proposed", "accepted"}
    assert "speculative ngram" in report["setup"]["engine"]


def test_spec_runs_no_peers(tiny_llama, capsys):
    assert main(["bench", "spec", "--model", tiny_llama, "--peers", "hf", "--scale", "0.05"]) == 1
    assert "runs no --peers" in capsys.readouterr().err


def test_prefix_on_a_hybrid_model_reports_the_state_snapshots(capsys, tmp_path):
    from engine.testing.checkpoints import make_tiny_checkpoint

    path = tmp_path / "tiny-qwen"
    make_tiny_checkpoint("Qwen3_5ForCausalLM", path)
    args = ["bench", "prefix", "--model", str(path), "--scale", "0.05", "--dtype", "float32"]
    assert main([*args, "--plugins", "cpu,qwen", "--state-snapshot-interval", "32", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)["sections"]["w3"]["figures"]
    assert figures["state_snapshots_mib"]["values"]["engine"] > 0
    assert "every 32 tokens" in figures["state_snapshots_mib"]["method"]
