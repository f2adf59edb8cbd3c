"""A KV tier's own counters on /metrics, as the renderer writes them for any tier: one
Prometheus counter per name, labelled with the tier, read back by prometheus_client's parser."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from engine.entrypoints.async_engine import EngineStats, KVTierCounters
from engine.entrypoints.metrics import ServerMetrics


def families(report: KVTierCounters | None) -> dict:
    metrics = ServerMetrics("tiny", EngineStats, lambda: report)
    return {family.name: family for family in text_string_to_metric_families(metrics.render().decode())}


def test_each_counter_of_a_tier_is_a_counter_labelled_with_the_tier():
    report = KVTierCounters(
        "my_tier",
        {"hits": 3.0, "engine_offered_blocks": 2.0},
        {"bad-reads": 4.0, "retries_total": 1.0, "bad_reads": 9.0},
    )
    found = families(report)
    assert {s.labels["counter"]: s.value for s in found["engine_kv_tier"].samples} == {
        "hits": 3.0,
        "engine_offered_blocks": 2.0,
    }
    # a name made a Prometheus name (the first in order keeps one that reads alike), and never
    # a second _total
    tier_families = {name: f for name, f in found.items() if name.startswith("engine_kv_tier_")}
    assert sorted(tier_families) == ["engine_kv_tier_bad_reads", "engine_kv_tier_retries"]
    for family, value in (("engine_kv_tier_bad_reads", 4.0), ("engine_kv_tier_retries", 1.0)):
        assert tier_families[family].type == "counter" and tier_families[family].documentation
        [sample] = tier_families[family].samples
        assert sample.name == family + "_total" and sample.value == value
        assert sample.labels == {"model_name": "tiny", "tier": "my_tier"}


def test_without_a_tier_there_is_no_tier_series():
    found = families(None)
    assert found["engine_kv_tier"].samples == []
    assert not [name for name in found if name.startswith("engine_kv_tier_")]
