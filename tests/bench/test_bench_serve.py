"""``engine bench serve`` against a live server on the demo model (in this process, on a
thread): every request completes with the lengths asked for, the client's figures agree
with what the server counted and saw, failures are counted with their message; the
arithmetic (percentiles, Poisson arrivals, lengths, the stream reader) on independent
references. No timing is asserted."""

from __future__ import annotations

import json
import math
import socket
import threading
import time

import httpx
import numpy as np
import pytest

from engine.bench.serve_load import ServeLoadOptions, ServeReport, run_serve_load
from engine.bench.serve_load.client import StreamReader
from engine.bench.serve_load.dataset import (
    PromptLengthFit,
    file_specs,
    poisson_arrivals,
    random_specs,
    spread,
)
from engine.bench.serve_load.stats import RequestRecord, Summary, percentile
from engine.cli import main

API_KEY = "bench-serve-test-key-0123456789"
TEST_REQUESTS = 2  # the untimed requests that fit prompt lengths before a run of random prompts

# -------------------------------------------------------------------------
# the arithmetic
# -------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 7, 100, 1001])
def test_percentile_is_numpys_linear_percentile(n):
    rng = np.random.default_rng(n)
    values = list(rng.exponential(3.0, size=n))
    for q in (0, 0.1, 1, 25, 50, 66.6, 90, 99, 99.9, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q), rel=1e-12, abs=1e-12)


def test_percentile_refuses_what_has_none():
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match="between 0 and 100"):
        percentile([1.0], 101)


def test_summary_is_in_ms_with_the_chosen_percentiles():
    summary = Summary.of([0.001, 0.002, 0.003, 0.010], (75, 90))
    assert summary.count == 4 and summary.mean == pytest.approx(4.0) and summary.median == pytest.approx(2.5)
    assert summary.percentiles[75] == pytest.approx(np.percentile([1, 2, 3, 10], 75))
    assert set(summary.as_dict()) == {"count", "mean", "median", "p75", "p90"}
    assert Summary.of([], (99,)).as_dict() == {"count": 0, "mean": None, "median": None, "p99": None}


def test_tpot_excludes_the_first_token():
    record = RequestRecord(0, None, 5, success=True, ttft=0.1, e2e=0.5, completion_tokens=5)
    assert record.tpot == pytest.approx((0.5 - 0.1) / 4)
    assert RequestRecord(0, None, 1, ttft=0.1, e2e=0.1, completion_tokens=1).tpot is None


def test_poisson_arrivals_have_the_rate_as_mean_and_exponential_gaps():
    rate = 8.0
    times = poisson_arrivals(20000, rate, seed=3)
    gaps = np.diff(times)
    assert times[0] == 0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert gaps.std() == pytest.approx(1 / rate, rel=0.05)  # an exponential's standard deviation is its mean
    assert (gaps < 1 / rate).mean() == pytest.approx(1 - math.exp(-1), abs=0.015)  # its CDF at the mean
    assert poisson_arrivals(50, rate, seed=3) == times[:50]
    assert poisson_arrivals(50, rate, seed=4) != times[:50]
    assert poisson_arrivals(5, math.inf, seed=3) == [0.0] * 5


def test_random_lengths_spread_uniformly_as_vllm():
    assert spread(100, 0.5) == (50, 150) and spread(3, 0.9) == (1, 6) and spread(10, 0) == (10, 10)
    specs = random_specs(4000, input_len=100, output_len=20, range_ratio=0.5, seed=1)
    inputs = [s.prompt_len for s in specs]
    assert min(inputs) == 50 and max(inputs) == 150
    assert np.mean(inputs) == pytest.approx(100, rel=0.02)
    assert all(10 <= s.output_len <= 30 for s in specs)
    assert random_specs(10, 100, 20, 0.5, seed=1) == specs[:10]
    assert {(s.prompt_len, s.output_len) for s in random_specs(10, 64, 8, 0, seed=1)} == {(64, 8)}


def test_a_dataset_file_takes_prompts_or_lengths_and_is_cycled(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        '{"prompt": "hello there", "output_len": 3}\n\n{"prompt_len": 40, "output_len": 7}\n{"prompt": "x"}\n'
    )
    specs, lines = file_specs(path, 5, default_output_len=9)
    assert lines == 3
    assert [(s.prompt, s.prompt_len, s.output_len) for s in specs] == [
        ("hello there", None, 3),
        (None, 40, 7),
        ("x", None, 9),
        ("hello there", None, 3),
        (None, 40, 7),
    ]
    path.write_text('{"prompt": "ok"}\n{"output_len": 3}\n')
    with pytest.raises(ValueError, match="line 2 needs a non-empty 'prompt' string or a positive integer 'prompt_len'"):
        file_specs(path, 2, 4)
    path.write_text("not json\n")
    with pytest.raises(ValueError, match="line 1 is not JSON"):
        file_specs(path, 1, 4)


def test_prompt_length_fit_is_the_line_through_two_measurements():
    fit = PromptLengthFit.through([(10, 17), (50, 77)])  # 1.5 tokens a word, 2 fixed
    assert fit.tokens_per_word == pytest.approx(1.5) and fit.fixed_tokens == pytest.approx(2.0)
    assert fit.words_for(62) == 40 and fit.words_for(1) == 1
    assert PromptLengthFit.through([(10, 20), (50, 20)]) == PromptLengthFit()  # no rise: one token a word


def test_the_stream_reader_times_content_chunks_and_takes_usage():
    record = RequestRecord(0, None, 3)
    reader = StreamReader(record, "chat", start=10.0)
    events = [
        (10.1, {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),  # no content yet
        (10.3, {"choices": [{"index": 0, "delta": {"content": "a"}}]}),
        (10.4, {"choices": [{"index": 0, "delta": {"content": "bc"}}]}),
        (10.7, {"choices": [{"index": 0, "delta": {"content": "d"}, "finish_reason": "length"}]}),
        (10.8, {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}}),
    ]
    for now, event in events:
        reader.feed(f"data: {json.dumps(event)}", now)
        reader.feed("", now)
    reader.feed("data: [DONE]", 10.9)
    assert reader.done and reader.finished and reader.error is None
    assert record.ttft == pytest.approx(0.3) and record.itl == pytest.approx([0.1, 0.3])
    assert record.num_chunks == 3 and record.output_tokens == 4 and record.prompt_tokens == 9  # usage wins

    without_usage = RequestRecord(0, None, 3)
    reader = StreamReader(without_usage, "completions", start=0.0)
    for now, text in [(0.5, "x"), (0.6, "y")]:
        reader.feed(f'data: {{"choices": [{{"index": 0, "text": "{text}"}}]}}', now)
    assert without_usage.output_tokens == 2  # chunks counted

    failed = RequestRecord(0, None, 3)
    reader = StreamReader(failed, "completions", start=0.0)
    reader.feed('data: {"error": {"message": "stopped by the shutdown", "type": "internal_server_error"}}', 1.0)
    assert reader.error == "error event in the stream: stopped by the shutdown"


def test_options_are_checked():
    with pytest.raises(ValueError, match="--range-ratio must be in"):
        ServeLoadOptions(range_ratio=1.0)
    with pytest.raises(ValueError, match="--max-concurrency must be at least 1"):
        ServeLoadOptions(max_concurrency=0)
    with pytest.raises(ValueError, match="--endpoint must be one of completions, chat"):
        ServeLoadOptions(endpoint="embeddings")


# -------------------------------------------------------------------------
# against a live server on the demo model
# -------------------------------------------------------------------------


class InFlightCounter:
    """ASGI middleware in front of the server: how many completion requests it held at once,
    from a request's arrival to just before the last body bytes of its reply go out (so a
    client cannot have seen a reply end while it is still counted), and how many it saw."""

    def __init__(self, app) -> None:
        self.app = app
        self.now = self.most = self.seen = 0

    def reset(self) -> None:
        self.now = self.most = self.seen = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].endswith("completions"):
            return await self.app(scope, receive, send)
        self.now += 1
        self.seen += 1
        self.most = max(self.most, self.now)
        counted = True

        async def send_counted(message) -> None:
            nonlocal counted
            if counted and message["type"] == "http.response.body" and not message.get("more_body", False):
                counted = False
                self.now -= 1
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            if counted:
                self.now -= 1


@pytest.fixture(scope="module")
def live():
    import uvicorn

    from engine.config import EngineConfig, ServerConfig
    from engine.entrypoints.serve import RunningServer, listen, make_app

    sock = listen("127.0.0.1", 0)
    app, engine = make_app(
        EngineConfig(model="demo", plugins=["cpu", "llama"], dtype="float32", kv_cache_memory=0.05),
        ServerConfig(port=0, api_key=API_KEY),
        progress=False,
    )
    counter = InFlightCounter(app)
    server = uvicorn.Server(uvicorn.Config(counter, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    while not server.started and thread.is_alive():
        time.sleep(0.02)
    running = RunningServer(*sock.getsockname()[:2], app, engine, server, thread)
    yield running, counter
    running.stop()


@pytest.fixture
def server(live):
    running, counter = live
    counter.reset()
    return running, counter


def generated_tokens(url: str) -> float:
    metrics = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    return sum(
        float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("engine_generation_tokens_total")
    )


def run(url: str, **options) -> ServeReport:
    options = {"base_url": url, "api_key": API_KEY, "input_len": 32, "output_len": 8, **options}
    return ServeReport(run_serve_load(ServeLoadOptions(**options), progress=False))


def test_every_request_completes_with_the_lengths_asked_under_the_concurrency_limit(server):
    running, counter = server
    before = generated_tokens(running.base_url)
    report = run(running.base_url, num_prompts=12, max_concurrency=3, range_ratio=0.5, ignore_eos=True)
    records = report.records
    assert len(report.done) == 12 and not report.failed
    assert report.result.model == "demo"  # the first (only) model /v1/models lists
    # the server honoured ignore_eos + min_tokens, and its usage says so
    assert [r.completion_tokens for r in records] == [r.output_len for r in records]
    assert len({r.output_len for r in records}) > 1  # the range ratio spread them
    # the server's own count of generated tokens: the run's, and one per test request
    assert generated_tokens(running.base_url) - before == sum(r.output_tokens for r in records) + TEST_REQUESTS
    for r in records:
        assert 0 < r.ttft <= r.e2e
        assert len(r.itl) == r.num_chunks - 1 and 1 <= r.num_chunks <= r.output_tokens
        assert r.prompt_tokens is not None
    # the server saw the run and the test requests, never more than 3 at once, and at times 3 (so the limit bit)
    assert counter.seen == 12 + TEST_REQUESTS
    assert 2 <= counter.most <= 3 and report.result.max_in_flight <= 3
    figures = report.as_dict()["figures"]
    assert figures["completed"]["value"] == 12 and figures["failed"]["value"] == 0
    output = sum(r.output_tokens for r in records)
    assert figures["output_throughput"]["value"] == pytest.approx(output / report.result.duration)
    total = output + sum(r.prompt_tokens for r in records)
    assert figures["total_throughput"]["value"] == pytest.approx(total / report.result.duration)
    ttfts = [r.ttft * 1e3 for r in records]
    assert report.latencies["ttft"].percentiles[90] == pytest.approx(np.percentile(ttfts, 90))
    assert report.latencies["itl"].count == sum(len(r.itl) for r in records)


def test_random_prompts_come_close_to_the_target_length(server):
    running, _ = server
    report = run(running.base_url, num_prompts=8, input_len=96, output_len=2)
    mean_prompt_tokens = np.mean([r.prompt_tokens for r in report.done])
    assert mean_prompt_tokens == pytest.approx(96, rel=0.15)
    assert report.result.fit.measured and len(report.result.fit_points) == TEST_REQUESTS
    assert report.as_dict()["figures"]["mean_input_tokens"]["value"] == pytest.approx(mean_prompt_tokens)


def test_requests_are_never_sent_before_their_poisson_arrival(server):
    running, _ = server
    report = run(running.base_url, num_prompts=10, request_rate=40.0, seed=5)
    assert [r.scheduled for r in report.records] == poisson_arrivals(10, 40.0, seed=5)
    assert all(r.start >= r.scheduled for r in report.records)
    assert len(report.done) == 10


@pytest.mark.parametrize("endpoint,stream", [("chat", True), ("completions", False)])
def test_chat_and_whole_responses_count_the_output_the_server_reports(server, endpoint, stream):
    running, _ = server
    report = run(running.base_url, num_prompts=4, endpoint=endpoint, stream=stream, ignore_eos=True)
    assert len(report.done) == 4
    assert all(r.output_tokens == r.output_len for r in report.records)
    if stream:
        assert all(0 < r.ttft <= r.e2e for r in report.records)
    else:  # no stream: no first token to time
        assert all(r.ttft is None for r in report.records) and report.latencies["ttft"].count == 0
        assert "TTFT, TPOT and ITL need a stream" in report.as_text()


def test_failed_requests_are_counted_with_the_servers_message(server, tmp_path):
    running, _ = server
    dataset = tmp_path / "prompts.jsonl"
    too_long = " ".join(["word"] * 3000)  # far past the demo model's 1024-token context
    dataset.write_text(
        json.dumps({"prompt": "def add(a, b):", "output_len": 4}) + "\n" + json.dumps({"prompt": too_long}) + "\n"
    )
    report = run(running.base_url, num_prompts=6, dataset=str(dataset))
    assert len(report.done) == 3 and len(report.failed) == 3
    assert {r.index for r in report.failed} == {1, 3, 5}
    assert all(r.status == 400 and r.error.startswith("HTTP 400: ") and "context" in r.error for r in report.failed)
    text = report.as_text()
    assert "errors: 3 failed requests, 1 distinct messages" in text and "  3 x HTTP 400: " in text
    assert report.as_dict()["errors"] == [{"message": report.failed[0].error, "count": 3}]


def test_timeouts_are_failures_and_a_run_without_successes_still_reports(server):
    running, _ = server
    report = run(running.base_url, num_prompts=3, output_len=32, timeout=0.001)
    assert not report.done and {r.error for r in report.failed} == {"timed out after 0.001 s"}
    assert report.latencies["e2e"].count == 0 and "3 x timed out after 0.001 s" in report.as_text()


def test_the_cli_prints_json_with_the_chosen_percentiles_and_every_request(server, capsys):
    running, _ = server
    args = ["bench", "serve", "--base-url", running.base_url + "/v1", "--api-key", API_KEY]
    args += ["--num-prompts", "4", "--input-len", "16", "--output-len", "4", "--ignore-eos"]
    assert main([*args, "--percentiles", "75,99.9", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["command"] == "serve" and report["model"] == "demo"
    assert report["figures"]["completed"]["value"] == 4 and len(report["requests"]) == 4
    assert set(report["latency_ms"]["ttft"]) == {"count", "mean", "median", "p75", "p99.9", "method"}
    assert [r["output_tokens"] for r in report["requests"]] == [4, 4, 4, 4]
    assert report["options"]["request_rate"] == "inf" and report["options"]["max_concurrency"] is None
    assert main([*args, "--max-concurrency", "2"]) == 0
    text = capsys.readouterr().out
    assert "results: 4 of 4 requests completed" in text and "at most 2 in flight" in text
    assert "  TTFT " in text and "p90" in text and "p99" in text


def test_the_cli_says_in_one_line_why_it_cannot_run(server, capsys):
    running, _ = server
    with socket.socket() as sock:  # a port bound and closed again: nothing listens there
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cases = [
        (
            ["--base-url", f"http://127.0.0.1:{port}"],
            f"Cannot reach http://127.0.0.1:{port}/v1/models (connection refused",
        ),
        (
            ["--base-url", running.base_url, "--api-key", API_KEY, "--model", "nope"],
            "does not serve model 'nope'; it serves demo",
        ),
        (["--base-url", running.base_url, "--api-key", "wrong"], "refused the request (HTTP 401"),
        (
            ["--base-url", running.base_url, "--api-key", API_KEY, "--input-len", "5000"],
            "5000 prompt + 128 output tokens does not fit the served model's context of 1024 tokens",
        ),
    ]
    for extra, message in cases:
        assert main(["bench", "serve", "--num-prompts", "2", *extra]) == 1
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
