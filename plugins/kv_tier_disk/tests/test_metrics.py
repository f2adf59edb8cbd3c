"""The disk tier's own counters on the server's /metrics: a segment damaged on disk between two
runs shows as corrupt blocks, a Prometheus counter labelled with the tier, once."""

from __future__ import annotations

from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

PROMPTS = ([3] * 80, [4] * 80, [5] * 80)  # 5 blocks of 16 tokens each; 6 blocks fit: each evicts the last


def serve(checkpoint: Path, root: Path):
    from engine.config import EngineConfig, ServerConfig
    from engine.entrypoints.serve import start_server

    config = EngineConfig(
        model=str(checkpoint),
        plugins=["cpu", "llama", "kv_tier_disk"],
        dtype="float32",
        max_model_len=96,
        kv_cache_memory=6 * 16 * 512 / 2**30,  # 512 bytes of KV a token
        kv_tier="disk",
        kv_tier_config={"path": str(root), "capacity_gb": 0.1},
    )
    return start_server(config, ServerConfig(port=0, served_model_name="tiny"))


def complete(running, prompt: list[int]) -> None:
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    assert httpx.post(running.base_url + "/v1/completions", json=body, timeout=60).status_code == 200


def scrape(running) -> dict:
    """/metrics parsed by prometheus_client's own parser of the text format: families by name."""
    reply = httpx.get(running.base_url + "/metrics", timeout=10)
    assert reply.status_code == 200
    return {family.name: family for family in text_string_to_metric_families(reply.text)}


def tier_counter(families: dict, name: str) -> float:
    family = families[f"engine_kv_tier_{name}"]
    assert family.type == "counter" and family.documentation
    [sample] = family.samples
    assert sample.name == f"engine_kv_tier_{name}_total"
    assert sample.labels == {"model_name": "tiny", "tier": "disk"}
    return sample.value


def test_metrics_show_the_corrupt_blocks_of_a_segment_cut_short_on_disk(tmp_path):
    from engine.testing.checkpoints import make_tiny_checkpoint

    checkpoint, root = tmp_path / "llama", tmp_path / "kv"
    make_tiny_checkpoint("LlamaForCausalLM", checkpoint)
    running = serve(checkpoint, root)
    try:
        for prompt in PROMPTS:
            complete(running, prompt)
        families = scrape(running)
        for name in ("corrupt_blocks", "lost_blocks", "dropped_blocks"):
            assert tier_counter(families, name) == 0
    finally:
        running.stop()  # the tier writes what it holds
    segments = sorted(root.rglob("*.kvs"))
    assert segments
    with open(segments[0], "r+b") as file:  # its last payload loses its last bytes
        file.truncate(segments[0].stat().st_size - 7)

    running = serve(checkpoint, root)
    try:
        families = scrape(running)
        assert tier_counter(families, "corrupt_blocks") == 1
        assert tier_counter(families, "lost_blocks") == tier_counter(families, "dropped_blocks") == 0
        complete(running, PROMPTS[0])
        assert tier_counter(scrape(running), "corrupt_blocks") == 1
    finally:
        running.stop()

    running = serve(checkpoint, root)  # the damage was repaired on disk: nothing to count again
    try:
        assert tier_counter(scrape(running), "corrupt_blocks") == 0
    finally:
        running.stop()
