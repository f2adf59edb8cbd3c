"""``engine bench serve``: check the server, fit prompt lengths to its tokenizer, then send
the requests at their arrival times under the concurrency limit and keep every record.

Before the timed run the client asks ``GET /v1/models`` (which model, and that the
server answers) and sends one or two untimed test requests of one output token: they
show that the server takes the run's parameters, and their ``usage.prompt_tokens``
says how many tokens random words make on the served model.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field

from engine.bench.serve_load.client import ENDPOINTS, RequestSettings, send
from engine.bench.serve_load.dataset import (
    PromptLengthFit,
    PromptSpec,
    file_specs,
    poisson_arrivals,
    prompt_texts,
    random_specs,
    random_text,
)
from engine.bench.serve_load.http_client import ConnectError, Connection, Server, error_message
from engine.bench.serve_load.stats import RequestRecord

API_KEY_ENVS = ("ENGINE_API_KEY", "OPENAI_API_KEY")
# a test request waits at least this long, whatever --timeout says for the timed ones
TEST_REQUEST_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class ServeLoadOptions:
    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None  # None: the first model GET /v1/models lists
    api_key: str | None = None  # None: $ENGINE_API_KEY, else $OPENAI_API_KEY
    endpoint: str = "completions"
    num_prompts: int = 100
    request_rate: float = math.inf
    max_concurrency: int | None = None
    dataset: str = "random"  # or a JSONL file
    input_len: int = 256
    output_len: int = 128
    range_ratio: float = 0.0
    seed: int = 0
    stream: bool = True
    ignore_eos: bool = False
    timeout: float = 600.0
    percentiles: tuple[float, ...] = (50.0, 90.0, 99.0)

    def __post_init__(self) -> None:
        checks = [
            (self.endpoint in ENDPOINTS, f"--endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}."),
            (self.num_prompts >= 1, f"--num-prompts must be at least 1, got {self.num_prompts}."),
            (self.request_rate > 0, f"--request-rate must be positive (inf: all at once), got {self.request_rate}."),
            (
                self.max_concurrency is None or self.max_concurrency >= 1,
                f"--max-concurrency must be at least 1, got {self.max_concurrency}.",
            ),
            (self.input_len >= 1, f"--input-len must be at least 1, got {self.input_len}."),
            (self.output_len >= 1, f"--output-len must be at least 1, got {self.output_len}."),
            (0 <= self.range_ratio < 1, f"--range-ratio must be in [0, 1), got {self.range_ratio}."),
            (self.timeout > 0, f"--timeout must be positive, got {self.timeout}."),
            (
                bool(self.percentiles) and all(0 < q <= 100 for q in self.percentiles),
                f"--percentiles must be numbers in (0, 100], got {','.join(f'{q:g}' for q in self.percentiles)}.",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def resolved_api_key(self) -> str | None:
        if self.api_key is not None:
            return self.api_key or None
        return next((os.environ[name] for name in API_KEY_ENVS if os.environ.get(name)), None)


@dataclass
class ServeLoadResult:
    """What one run found: the model asked for, the records in request order, the wall time
    from the first send to the last reply, and how the prompts were made."""

    options: ServeLoadOptions
    server_url: str
    model: str
    records: list[RequestRecord]
    duration: float
    max_in_flight: int
    fit: PromptLengthFit | None  # None: every prompt came as text
    fit_points: list[tuple[int, int]] = field(default_factory=list)  # (words, prompt tokens) of the test requests
    dataset_lines: int | None = None  # lines of a --dataset file
    max_model_len: int | None = None  # as /v1/models says, when it does


def run_serve_load(options: ServeLoadOptions, *, progress: bool = True) -> ServeLoadResult:
    return asyncio.run(_run(options, progress))


async def _run(options: ServeLoadOptions, progress: bool) -> ServeLoadResult:
    server = Server.from_url(options.base_url)
    api_key = options.resolved_api_key()
    model, max_model_len = await served_model(server, options.model, api_key)
    settings = RequestSettings(options.endpoint, model, options.stream, options.ignore_eos, api_key, options.timeout)
    specs, lines = _specs(options)
    _check_lengths(specs, max_model_len)
    fit, points = await _fit_prompt_lengths(server, settings, specs, max_model_len)
    texts = prompt_texts(specs, fit or PromptLengthFit(), options.seed)
    if fit is None:  # prompts given as text: one test request with the first
        await _test_request(server, settings, texts[0])
    arrivals = poisson_arrivals(len(specs), options.request_rate, options.seed)
    records = [
        RequestRecord(i, s.prompt_len, s.output_len, scheduled=t) for i, (s, t) in enumerate(zip(specs, arrivals))
    ]
    duration, most = await _send_all(server, settings, texts, records, options.max_concurrency, progress)
    return ServeLoadResult(options, server.url, model, records, duration, most, fit, points, lines, max_model_len)


def _specs(options: ServeLoadOptions) -> tuple[list[PromptSpec], int | None]:
    if options.dataset == "random":
        specs = random_specs(
            options.num_prompts, options.input_len, options.output_len, options.range_ratio, options.seed
        )
        return specs, None
    return file_specs(options.dataset, options.num_prompts, options.output_len)


def _check_lengths(specs: list[PromptSpec], max_model_len: int | None) -> None:
    longest = max(
        (s for s in specs if s.prompt_len is not None), key=lambda s: s.prompt_len + s.output_len, default=None
    )
    if max_model_len is not None and longest is not None and longest.prompt_len + longest.output_len > max_model_len:
        raise ValueError(
            f"A request of {longest.prompt_len} prompt + {longest.output_len} output tokens does not fit the served "
            f"model's context of {max_model_len} tokens (its max_model_len in /v1/models); lower --input-len, "
            "--output-len or --range-ratio."
        )


# -------------------------------------------------------------------------
# before the run: the model, and test requests
# -------------------------------------------------------------------------


async def served_model(server: Server, model: str | None, api_key: str | None) -> tuple[str, int | None]:
    """(the model to ask for, its max_model_len if listed): ``model`` when the server lists it
    (or lists nothing), else the first listed one when ``model`` is None."""
    settings = RequestSettings("completions", model or "", api_key=api_key)
    try:
        async with Connection(server) as connection:
            response = await asyncio.wait_for(
                connection.send("GET", "/models", settings.headers()), TEST_REQUEST_TIMEOUT_S
            )
            body = await response.read()
    except (ConnectError, asyncio.IncompleteReadError) as exc:
        raise ConnectionError(
            f"Cannot reach {server.url}/models ({exc}). Is the server running? Start one with 'engine serve', "
            "or point --base-url at it."
        ) from None
    except asyncio.TimeoutError:
        raise ConnectionError(f"{server.url}/models did not answer within {TEST_REQUEST_TIMEOUT_S:g} s.") from None
    if response.status in (401, 403):
        raise PermissionError(
            f"{server.url}/models refused the request ({error_message(response.status, body)}): pass the server's "
            f"key with --api-key, or set {' or '.join(API_KEY_ENVS)}."
        )
    if response.status == 404 and model is not None:
        return model, None  # a server without the listing: trust --model
    if response.status != 200:
        raise ConnectionError(
            f"{server.url}/models answered {error_message(response.status, body)}; is --base-url an "
            "OpenAI-compatible server?"
        )
    listed = [m for m in json.loads(body).get("data", []) if isinstance(m, dict) and "id" in m]
    ids = [m["id"] for m in listed]
    if model is None:
        if not ids:
            raise ValueError(f"{server.url}/models lists no model; name one with --model.")
        model = ids[0]
    elif ids and model not in ids:
        raise ValueError(
            f"The server at {server.url} does not serve model {model!r}; it serves {', '.join(ids)}. "
            "Pass one of them with --model."
        )
    entry = next((m for m in listed if m["id"] == model), {})
    max_model_len = entry.get("max_model_len")
    return model, max_model_len if isinstance(max_model_len, int) else None


async def _test_request(server: Server, settings: RequestSettings, prompt: str) -> RequestRecord:
    """One untimed request of the run's kind with one output token; a failure stops the run."""
    test = RequestSettings(
        settings.endpoint,
        settings.model,
        stream=False,
        ignore_eos=settings.ignore_eos,
        api_key=settings.api_key,
        timeout=max(settings.timeout, TEST_REQUEST_TIMEOUT_S),
    )
    record = RequestRecord(-1, None, 1)
    await send(server, test, prompt, record, time.perf_counter())
    if not record.success:
        raise ValueError(
            f"A test request to {server.url}{ENDPOINTS[settings.endpoint]} (model {settings.model!r}, one output "
            f"token) failed: {(record.error or '').rstrip('.')}. Nothing was measured; check the options against "
            "what the server takes."
        )
    return record


async def _fit_prompt_lengths(
    server: Server, settings: RequestSettings, specs: list[PromptSpec], max_model_len: int | None
) -> tuple[PromptLengthFit | None, list[tuple[int, int]]]:
    """Two test requests of random words, a quarter and twice the mean target length, and the
    line through their prompt token counts; None when every prompt came as text."""
    targets = [s.prompt_len for s in specs if s.prompt is None and s.prompt_len is not None]
    if not targets:
        return None, []
    mean_target = round(sum(targets) / len(targets))
    few, many = max(1, mean_target // 4), max(mean_target // 4 + 16, 2 * mean_target)
    if max_model_len is not None:  # stay inside the context: random words are seldom over 4 tokens
        few = min(few, max_model_len // 16)
        many = max(few + 1, min(many, max_model_len // 4))
    rng = random.Random("test requests")
    points = []
    for words in (few, many):
        record = await _test_request(server, settings, random_text(words, rng))
        if record.prompt_tokens is None:
            return PromptLengthFit(), []  # no usage: one token a word, unmeasured
        points.append((words, record.prompt_tokens))
    return PromptLengthFit.through(points), points


# -------------------------------------------------------------------------
# the timed run
# -------------------------------------------------------------------------


@dataclass
class _InFlight:
    now: int = 0
    most: int = 0


async def _send_all(
    server: Server,
    settings: RequestSettings,
    texts: list[str],
    records: list[RequestRecord],
    max_concurrency: int | None,
    progress: bool,
) -> tuple[float, int]:
    """Send each request at its scheduled time (waiting for a free slot under ``max_concurrency``);
    returns (first send -> last reply in seconds, the most requests in flight at once)."""
    from tqdm import tqdm

    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    in_flight = _InFlight()
    bar = tqdm(total=len(records), desc="requests", unit="req", file=sys.stderr, disable=None if progress else True)

    async def one(record: RequestRecord) -> None:
        if slots is not None:
            await slots.acquire()
        in_flight.now += 1
        in_flight.most = max(in_flight.most, in_flight.now)
        try:
            await send(server, settings, texts[record.index], record, t0)
        finally:
            in_flight.now -= 1
            if slots is not None:
                slots.release()
            bar.update(1)

    t0 = time.perf_counter()
    tasks = []
    for record in records:
        while (delay := t0 + record.scheduled - time.perf_counter()) > 0:  # a timer may fire a hair early
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(record)))
    await asyncio.gather(*tasks)
    duration = time.perf_counter() - t0
    bar.close()
    return duration, in_flight.most
