"""Prometheus metrics of the server, in a registry of its own (no process globals).

Request-level figures are observed by the HTTP side as requests end; engine
gauges are read from the engine loop's latest ``EngineStats`` at scrape time.
The KV tier's and speculative decoding's counters are read from the engine at
scrape time too; a tier's own counters (``KVTierStats.extra_counters``) become
counters ``engine_kv_tier_<name>_total`` labelled with the tier's name.
"""

from __future__ import annotations

import re
from typing import Callable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,  # noqa: F401  (re-exported for the app)
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from engine.entrypoints.async_engine import EngineStats, KVTierCounters
from engine.spec_decode.decoder import SpecDecodeStats

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)


class ServerMetrics:
    """The server's series. ``model_name`` labels every one of them."""

    def __init__(
        self,
        model_name: str,
        stats: Callable[[], EngineStats],
        tier_counters: Callable[[], KVTierCounters | None] = lambda: None,
        spec_stats: Callable[[], SpecDecodeStats | None] = lambda: None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._stats = stats
        self._spec_stats = spec_stats
        labels = ["model_name"]
        r = self.registry
        self.requests = Counter(
            "engine_requests",
            "Requests answered, by endpoint and outcome (HTTP status, or finish reason).",
            labels + ["endpoint", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter("engine_prompt_tokens", "Prompt tokens of admitted requests.", labels, registry=r)
        self.generation_tokens = Counter("engine_generation_tokens", "Output tokens generated.", labels, registry=r)
        self.ttft = Histogram(
            "engine_time_to_first_token_seconds",
            "Time from arrival to the first output token.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "engine_inter_token_latency_seconds",
            "Time between consecutive output tokens of a sample.",
            labels,
            buckets=_TOKEN_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "engine_e2e_request_latency_seconds",
            "Time from arrival to the last output token.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.running = Gauge("engine_num_requests_running", "Sequences in the running batch.", labels, registry=r)
        self.waiting = Gauge("engine_num_requests_waiting", "Sequences waiting to be scheduled.", labels, registry=r)
        self.kv_usage = Gauge(
            "engine_kv_cache_usage_ratio", "Share of KV-cache blocks held by requests.", labels, registry=r
        )
        self.prefix_queries = Gauge(
            "engine_prefix_cache_queries_tokens",
            "Prompt tokens looked up in the prefix cache (cumulative).",
            labels,
            registry=r,
        )
        self.prefix_hits = Gauge(
            "engine_prefix_cache_hits_tokens",
            "Prompt tokens found in the prefix cache (cumulative).",
            labels,
            registry=r,
        )
        self.prefix_hit_rate = Gauge(
            "engine_prefix_cache_hit_rate", "Prefix-cache hits over queries since start.", labels, registry=r
        )
        self.preemptions = Gauge(
            "engine_num_preemptions", "Requests preempted since start (cumulative).", labels, registry=r
        )
        r.register(KVTierCollector(model_name, tier_counters))
        self.spec = {
            name: Gauge(f"engine_spec_decode_{name}", help_text, labels, registry=r)
            for name, help_text in (
                ("draft_rounds", "Verifications of a request with at least one draft (cumulative)."),
                ("draft_tokens", "Draft tokens verified (cumulative)."),
                ("accepted_tokens", "Draft tokens accepted (cumulative)."),
                ("acceptance_rate", "Accepted over verified draft tokens since start."),
                ("mean_accepted_length", "Tokens a draft round produced on average (accepted drafts + 1)."),
            )
        }
        self.spec_by_position = Gauge(
            "engine_spec_decode_acceptance_rate_by_position",
            "Accepted over verified drafts at each draft position (0: the first draft after the last token).",
            labels + ["position"],
            registry=r,
        )
        self.model_name = model_name

    def observe_finished(
        self,
        endpoint: str,
        status: str,
        prompt_tokens: int,
        output_tokens: int,
        ttft: float | None,
        token_gaps: list[float],
        e2e: float,
    ) -> None:
        m = self.model_name
        self.requests.labels(m, endpoint, status).inc()
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.generation_tokens.labels(m).inc(output_tokens)
        if ttft is not None:
            self.ttft.labels(m).observe(ttft)
        itl = self.itl.labels(m)
        for gap in token_gaps:
            itl.observe(gap)
        self.e2e.labels(m).observe(e2e)

    def count_rejected(self, endpoint: str, status: int) -> None:
        self.requests.labels(self.model_name, endpoint, str(status)).inc()

    def render(self) -> bytes:
        stats, m = self._stats(), self.model_name
        self.running.labels(m).set(stats.num_running)
        self.waiting.labels(m).set(stats.num_waiting)
        self.kv_usage.labels(m).set(stats.kv_cache_usage)
        self.prefix_queries.labels(m).set(stats.prefix_cache_queries)
        self.prefix_hits.labels(m).set(stats.prefix_cache_hits)
        rate = stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0
        self.prefix_hit_rate.labels(m).set(rate)
        self.preemptions.labels(m).set(stats.num_preemptions)
        spec = self._spec_stats()
        if spec is not None:
            values = {
                "draft_rounds": spec.rounds,
                "draft_tokens": spec.proposed,
                "accepted_tokens": spec.accepted,
                "acceptance_rate": spec.acceptance_rate,
                "mean_accepted_length": spec.mean_accepted_length,
            }
            for name, value in values.items():
                self.spec[name].labels(m).set(value)
            for position, rate in enumerate(spec.acceptance_by_position()):
                self.spec_by_position.labels(m, str(position)).set(rate)
        return generate_latest(self.registry)


class KVTierCollector:
    """The KV tier's series, read from the engine once a scrape: the gauge ``engine_kv_tier``
    with a ``counter`` label for each ``KVTierStats`` counter and the engine's transfers, and a
    counter ``engine_kv_tier_<name>_total{tier}`` for each of the tier's ``extra_counters``."""

    def __init__(self, model_name: str, read: Callable[[], KVTierCounters | None]) -> None:
        self.model_name = model_name
        self._read = read

    def describe(self) -> list[Metric]:
        """The fixed family only: the tier's own counters are known once it reports them."""
        return [self._gauge()]

    def collect(self) -> Iterator[Metric]:
        report = self._read()
        gauge = self._gauge()
        if report is None:
            yield gauge
            return
        for counter, value in report.counters.items():
            gauge.add_metric([self.model_name, counter], value)
        yield gauge
        names = set()
        for counter, value in sorted(report.extra_counters.items()):
            name = tier_counter_name(counter)
            if name in names:
                continue  # two of the tier's names that read alike here: the first one stands
            names.add(name)
            family = CounterMetricFamily(
                name,
                f"The KV tier's own counter {counter!r} since it opened (KVTierStats.extra_counters).",
                labels=["model_name", "tier"],
            )
            family.add_metric([self.model_name, report.tier], value)
            yield family

    @staticmethod
    def _gauge() -> GaugeMetricFamily:
        return GaugeMetricFamily(
            "engine_kv_tier",
            "The KV tier's counters since start (cumulative): blocks, bytes, failures, seconds; "
            "engine_* counters are the engine's own transfers (offered, prefetched blocks).",
            labels=["model_name", "counter"],
        )


def tier_counter_name(counter: str) -> str:
    """The metric family of a tier's counter: ``engine_kv_tier_`` and its name with anything but
    letters, digits and underscores made an underscore (a Prometheus name) and without a
    ``_total`` of its own (the sample gets one)."""
    return "engine_kv_tier_" + re.sub(r"[^A-Za-z0-9_]", "_", counter).removesuffix("_total")
