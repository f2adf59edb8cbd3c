"""The JSON a peer worker reads and writes; the standard library only, as it runs in the
peer's own Python.

A job (written by the bench)::

    {"protocol": 1, "model": PATH, "dtype": "bfloat16", "submission": "one after another" | "all at once",
     "warmup": REQUEST, "requests": [REQUEST, ...], "repeat": N, "threads": T, "settings": {...}}

where a REQUEST is ``{"prompt_token_ids": [...], "output_len": n}`` and ``settings`` are the
worker's own (vLLM's max_model_len, the GGUF path, ...).

A result (written by the worker once every run is done)::

    {"protocol": 1, "versions": {...}, "settings": {...},
     "runs": [{"wall": s, "requests": [{"submitted": t, "token_times": [t_1, ..., t_n]}, ...]}, ...]}

with one run per ``repeat``, one entry per request in the job's order, and ``t_k`` the
``time.perf_counter()`` at which token k was available: exactly ``output_len`` of them.
``versions`` and ``settings`` say what ran, for the report's setup line.
"""

from __future__ import annotations

import json
import time
from typing import Any, Sequence

PROTOCOL = 1
SEQUENTIAL = "one after another"
ALL_AT_ONCE = "all at once"
SUBMISSIONS = (SEQUENTIAL, ALL_AT_ONCE)


class ProtocolError(ValueError):
    """A job or a result that is not what this protocol says."""


def _request(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ProtocolError(f"{where}: expected an object, got {type(value).__name__}.")
    ids, output_len = value.get("prompt_token_ids"), value.get("output_len")
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
        raise ProtocolError(f"{where}.prompt_token_ids: expected a non-empty list of token ids.")
    if not isinstance(output_len, int) or isinstance(output_len, bool) or output_len < 1:
        raise ProtocolError(f"{where}.output_len: expected a positive integer, got {output_len!r}.")
    return {"prompt_token_ids": ids, "output_len": output_len}


def check_job(job: Any) -> dict[str, Any]:
    """The job, validated: every field present and of its type."""
    if not isinstance(job, dict):
        raise ProtocolError("A job is a JSON object.")
    if job.get("protocol") != PROTOCOL:
        raise ProtocolError(f"Job protocol {job.get('protocol')!r}; this worker speaks {PROTOCOL}.")
    for key in ("model", "dtype"):
        if not isinstance(job.get(key), str) or not job[key]:
            raise ProtocolError(f"job.{key}: expected a non-empty string.")
    if job.get("submission") not in SUBMISSIONS:
        raise ProtocolError(f"job.submission: expected one of {SUBMISSIONS}, got {job.get('submission')!r}.")
    requests = job.get("requests")
    if not isinstance(requests, list) or not requests:
        raise ProtocolError("job.requests: expected a non-empty list.")
    for key in ("repeat", "threads"):
        if not isinstance(job.get(key), int) or job[key] < 1:
            raise ProtocolError(f"job.{key}: expected a positive integer, got {job.get(key)!r}.")
    if not isinstance(job.get("settings", {}), dict):
        raise ProtocolError("job.settings: expected an object.")
    return {
        **job,
        "warmup": _request(job.get("warmup"), "job.warmup"),
        "requests": [_request(r, f"job.requests[{i}]") for i, r in enumerate(requests)],
        "settings": job.get("settings", {}),
    }


def read_job(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return check_job(json.load(f))


class RequestClock:
    """One request's stamps: when it was submitted and when each of its tokens was available."""

    def __init__(self) -> None:
        self.submitted: float | None = None
        self.token_times: list[float] = []

    def submit(self) -> None:
        self.submitted = time.perf_counter()

    def tokens(self, count: int, when: float) -> None:
        self.token_times.extend([when] * count)

    def as_dict(self) -> dict[str, Any]:
        return {"submitted": self.submitted, "token_times": self.token_times}


def check_lengths(clocks: Sequence[RequestClock], requests: Sequence[dict[str, Any]], peer: str) -> None:
    """Every request produced exactly its stated number of tokens (a RuntimeError names the first that did not)."""
    for i, (clock, request) in enumerate(zip(clocks, requests)):
        if clock.submitted is None or len(clock.token_times) != request["output_len"]:
            raise RuntimeError(
                f"{peer}: request {i} produced {len(clock.token_times)} tokens, asked for exactly {request['output_len']}."
            )


def run_record(wall: float, clocks: Sequence[RequestClock]) -> dict[str, Any]:
    return {"wall": wall, "requests": [c.as_dict() for c in clocks]}


def write_result(path: str, versions: dict[str, Any], settings: dict[str, Any], runs: list[dict[str, Any]]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"protocol": PROTOCOL, "versions": versions, "settings": settings, "runs": runs}, f)


def check_result(result: Any, job: dict[str, Any]) -> dict[str, Any]:
    """The result of ``job``, validated: ``repeat`` runs, each with every request's stamps,
    ``output_len`` tokens each, in time order and after the request's submission."""
    if not isinstance(result, dict):
        raise ProtocolError("A result is a JSON object.")
    if result.get("protocol") != PROTOCOL:
        raise ProtocolError(f"Result protocol {result.get('protocol')!r}; the bench speaks {PROTOCOL}.")
    for key in ("versions", "settings"):
        if not isinstance(result.get(key), dict):
            raise ProtocolError(f"result.{key}: expected an object.")
    runs = result.get("runs")
    if not isinstance(runs, list) or len(runs) != job["repeat"]:
        raise ProtocolError(f"result.runs: expected {job['repeat']} run(s), got {runs if runs is None else len(runs)}.")
    requests = job["requests"]
    for r, run in enumerate(runs):
        where = f"result.runs[{r}]"
        if not isinstance(run, dict) or not isinstance(run.get("wall"), (int, float)) or run["wall"] <= 0:
            raise ProtocolError(f"{where}.wall: expected a positive number of seconds.")
        stamps = run.get("requests")
        if not isinstance(stamps, list) or len(stamps) != len(requests):
            raise ProtocolError(f"{where}.requests: expected {len(requests)} entries, one per request.")
        for i, (stamp, request) in enumerate(zip(stamps, requests)):
            at = f"{where}.requests[{i}]"
            submitted, times = (
                (stamp.get("submitted"), stamp.get("token_times")) if isinstance(stamp, dict) else (None, None)
            )
            if not isinstance(submitted, (int, float)) or not isinstance(times, list):
                raise ProtocolError(f"{at}: expected submitted (a number) and token_times (a list).")
            if len(times) != request["output_len"]:
                raise ProtocolError(
                    f"{at}: {len(times)} token times for a request of exactly {request['output_len']} tokens."
                )
            if not all(isinstance(t, (int, float)) for t in times) or any(
                b < a for a, b in zip([submitted, *times], times)
            ):
                raise ProtocolError(f"{at}.token_times: expected numbers in time order, none before submitted.")
    return result
