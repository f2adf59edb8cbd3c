"""``engine bench serve``'s results as a table or as JSON, each figure with how it was
obtained, in the manner of the other ``engine bench`` reports."""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

from engine.bench.serve_load.client import ENDPOINTS
from engine.bench.serve_load.runner import ServeLoadResult
from engine.bench.serve_load.stats import Summary, latency_summaries

MAX_ERRORS_SHOWN = 5
LATENCIES = {
    "ttft": ("TTFT", "time to first token: request sent -> first chunk with content arrived."),
    "tpot": ("TPOT", "time per output token after the first: (E2E - TTFT) / (output tokens - 1), per request."),
    "itl": ("ITL", "inter-token latency: time between successive content chunks, every gap of every request."),
    "e2e": ("E2E", "end-to-end latency: request sent -> the end of the response's body arrived."),
}


@dataclass(frozen=True)
class Row:
    key: str
    label: str
    unit: str
    value: float | None
    method: str
    fmt: str = ".2f"

    def text(self) -> str:
        return "-" if self.value is None else f"{self.value:{self.fmt}}"


class ServeReport:
    def __init__(self, result: ServeLoadResult) -> None:
        self.result = result
        options = result.options
        self.records = result.records
        self.done = [r for r in self.records if r.success]
        self.failed = [r for r in self.records if not r.success]
        self.latencies = latency_summaries(self.records, options.percentiles)
        self.errors = Counter(r.error for r in self.failed).most_common()
        self.setup = self._setup()
        self.rows = self._rows()
        self.notes = self._notes()

    # what was run
    def _setup(self) -> dict[str, str]:
        r, o = self.result, self.result.options
        kind = "streamed, usage from stream_options.include_usage" if o.stream else "whole responses (--no-stream)"
        eos = "; ignore_eos and min_tokens = the output length" if o.ignore_eos else ""
        rate = "all at once" if math.isinf(o.request_rate) else f"{o.request_rate:g} requests/s, Poisson arrivals"
        limit = f"at most {o.max_concurrency} in flight" if o.max_concurrency else "no concurrency limit"
        if o.dataset == "random":
            data = (
                f"random words, target input {o.input_len} tokens, output {o.output_len} tokens, "
                f"range ratio {o.range_ratio:g}, seed {o.seed}"
            )
        else:
            cycled = f", cycled over its {r.dataset_lines} lines" if (r.dataset_lines or 0) < o.num_prompts else ""
            data = f"{o.dataset}{cycled}, seed {o.seed}"
        return {
            "server": f"{r.server_url}{ENDPOINTS[o.endpoint]}, model {r.model} ({kind}{eos})",
            "load": f"{o.num_prompts} requests, {rate}, {limit}",
            "dataset": data,
            "machine": f"{os.cpu_count()} CPUs, 1-minute load average {os.getloadavg()[0]:.2f} at end",
        }

    def _rows(self) -> list[Row]:
        r, done, seconds = self.result, self.done, self.result.duration
        output = sum(x.output_tokens for x in done)
        prompt_known = [x.prompt_tokens for x in done if x.prompt_tokens is not None]
        prompt = sum(prompt_known) if len(prompt_known) == len(done) else None
        targets = [x.prompt_len for x in self.records if x.prompt_len is not None]
        rows = [
            Row("completed", "completed requests", "", len(done), "replies with status 200 and a complete body.", "d"),
            Row(
                "failed",
                "failed requests",
                "",
                len(self.failed),
                "HTTP errors, error events, timeouts, broken connections (messages below).",
                "d",
            ),
            Row("duration_s", "duration", "s", seconds, "first request sent -> last reply finished."),
            Row("request_throughput", "request throughput", "req/s", len(done) / seconds, "completed / duration."),
            Row(
                "output_throughput",
                "output token throughput",
                "tok/s",
                output / seconds,
                "output tokens of the completed requests / duration (usage.completion_tokens; content chunks "
                "where the server gave no usage).",
            ),
            Row(
                "total_throughput",
                "total token throughput",
                "tok/s",
                None if prompt is None else (prompt + output) / seconds,
                "(usage.prompt_tokens + output tokens) of the completed requests / duration.",
            ),
            Row(
                "mean_input_tokens",
                "mean input length",
                "tokens",
                _mean(prompt_known),
                "usage.prompt_tokens as the server counted it (chat: with its template), completed requests.",
            ),
        ]
        if targets:
            rows.append(Row("mean_target_input_len", "  target", "tokens", _mean(targets), self._fit_text(), ".1f"))
        rows += [
            Row(
                "mean_output_tokens",
                "mean output length",
                "tokens",
                _mean([x.output_tokens for x in done]),
                f"output tokens per completed request (asked for: mean {_mean([x.output_len for x in self.records]):.1f}).",
            ),
            Row(
                "max_in_flight",
                "most requests in flight",
                "",
                r.max_in_flight,
                "the most requests sent and not yet answered at one time, counted by the client.",
                "d",
            ),
        ]
        return rows

    def _fit_text(self) -> str:
        fit, points = self.result.fit, self.result.fit_points
        if fit is None:
            return "the dataset's prompt_len."
        if not fit.measured:
            return (
                "the dataset's target; the server reported no prompt tokens, so a random word was taken as one token."
            )
        measured = " and ".join(f"{w} words -> {t} tokens" for w, t in points)
        return (
            f"the target; random words at {fit.tokens_per_word:.3f} tokens a word {fit.fixed_tokens:+.1f}, the "
            f"line through two untimed test requests ({measured})."
        )

    def _notes(self) -> list[str]:
        notes = [
            "Before the run: GET /v1/models and untimed test requests of one output token (they also warm the "
            "server up). Times are time.perf_counter() at the client, one HTTP/1.1 connection per request; "
            "greedy (temperature 0)."
        ]
        if not self.result.options.stream:
            notes.append("--no-stream: TTFT, TPOT and ITL need a stream and are not measured.")
        return notes

    # as data
    def as_dict(self) -> dict[str, Any]:
        return {
            "command": "serve",
            "setup": self.setup,
            "options": {**asdict(self.result.options), "request_rate": _number(self.result.options.request_rate)},
            "model": self.result.model,
            "figures": {
                row.key: {"label": row.label, "unit": row.unit, "value": row.value, "method": row.method}
                for row in self.rows
            },
            "latency_ms": {
                key: {**summary.as_dict(), "method": LATENCIES[key][1]} for key, summary in self.latencies.items()
            },
            "errors": [{"message": message, "count": count} for message, count in self.errors],
            "prompt_length_fit": None if self.result.fit is None else asdict(self.result.fit),
            "max_model_len": self.result.max_model_len,
            "notes": self.notes,
            "requests": [r.as_dict() for r in self.records],
        }

    def as_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2)

    def as_text(self) -> str:
        lines = ["engine bench serve", *(f"  {k}: {v}" for k, v in self.setup.items())]
        lines += [f"  {note}" for note in self.notes]
        title = f"results: {len(self.done)} of {len(self.records)} requests completed in {self.result.duration:.2f} s"
        lines += ["", title]
        table = [
            [row.label + (f" ({row.unit})" if row.unit else ""), row.text(), f"[{n}]"]
            for n, row in enumerate(self.rows, 1)
        ]
        lines += _aligned(["figure", "value", "method"], table)
        lines += [f"  [{n}] {row.method}" for n, row in enumerate(self.rows, 1)]
        qs = [q for q in self.result.options.percentiles if q != 50]
        lines += ["", f"latency (ms) over the {len(self.done)} completed requests"]
        header = ["", "mean", "median", *(f"p{q:g}" for q in qs), "n", "method"]
        table = [
            [name, *(_ms(v) for v in (s.mean, s.median, *(s.percentiles[q] for q in qs))), str(s.count), f"[{n}]"]
            for n, (name, s) in enumerate(self._named_latencies(), 1)
        ]
        lines += _aligned(header, table)
        lines += [f"  [{n}] {LATENCIES[key][1]}" for n, key in enumerate(self.latencies, 1)]
        if self.errors:
            shown = self.errors[:MAX_ERRORS_SHOWN]
            lines += ["", f"errors: {len(self.failed)} failed requests, {len(self.errors)} distinct messages"]
            lines += [f"  {count} x {message}" for message, count in shown]
            if len(self.errors) > len(shown):
                lines.append(f"  ... {len(self.errors) - len(shown)} more (all of them in --json)")
        return "\n".join(lines)

    def _named_latencies(self) -> list[tuple[str, Summary]]:
        return [(LATENCIES[key][0], summary) for key, summary in self.latencies.items()]


def _mean(values: list) -> float | None:
    return sum(values) / len(values) if values else None


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _number(value: float) -> float | str:
    return "inf" if math.isinf(value) else value


def _aligned(header: list[str], rows: list[list[str]]) -> list[str]:
    """The first column left-aligned, the middle ones right-aligned, the last (the method's
    footnote) as it is; as the other bench tables."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        middle = [cell.rjust(width) for cell, width in zip(cells[1:-1], widths[1:-1])]
        return "  " + "  ".join([cells[0].ljust(widths[0]), *middle, cells[-1]]).rstrip()

    return [line(header), "  " + "-" * (sum(widths) + 2 * (len(widths) - 1)), *(line(row) for row in rows)]
