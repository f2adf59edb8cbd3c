"""KV tiers carry latent caches: DeepSeek-V3's MLA entries, V3.2's indexer keys beside them and
V4's sparse-MLA entries and per-token compressor states go to the disk tier as evicted
prefix-cache blocks and come back, in this engine and in a new one started on the same
directory, with the outputs of an engine without a tier."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
BLOCK = 4
BLOCKS = 24  # each 70-token prompt evicts the previous ones


def prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, 320) for _ in range(70)] for _ in range(5)]


def one_by_one(llm: LLM, batch: list[list[int]]) -> list[list[int]]:
    return [llm.generate([p], PARAMS, use_tqdm=False)[0].outputs[0].token_ids for p in batch]


@pytest.mark.parametrize("architecture", ["DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "DeepseekV4ForCausalLM"])
def test_latent_blocks_come_back_from_the_disk_tier_across_a_restart(tmp_path, architecture):
    from engine.runtime.kv_tier_connector import tier_spec
    from engine.testing.checkpoints import make_tiny_checkpoint

    path = tmp_path / "model"
    make_tiny_checkpoint(architecture, path)
    batch = prompts()
    plain = LLM(str(path), plugins=["cpu", "deepseek_v4"], dtype="float32", progress=False, block_size=BLOCK)
    reference = one_by_one(plain, batch)
    kv_cache = plain.engine.shard.runner.kv_cache
    spec = tier_spec(kv_cache, b"", plain.engine.setup.dtype)
    assert spec.keys_only  # the MLA layers (and V3.2's indexers) cache one tensor a token
    # the cache's bytes per block, every layer's tensors included
    block_bytes = sum(c.numel() * c.element_size() for c in kv_cache.layer_caches) // kv_cache.num_blocks

    def with_tier() -> LLM:
        return LLM(
            str(path),
            plugins=["cpu", "deepseek_v4", "kv_tier_disk"],
            dtype="float32",
            progress=False,
            block_size=BLOCK,
            max_model_len=96,
            kv_cache_memory=BLOCKS * block_bytes / 2**30,
            kv_tier="disk",
            kv_tier_config={"path": str(tmp_path / "tier"), "capacity_gb": 0.1},
        )

    first = with_tier()
    assert first.engine.kv_tier.spec.keys_only == spec.keys_only
    assert one_by_one(first, batch) == reference
    first.engine.close()
    again = with_tier()
    assert one_by_one(again, batch) == reference
    assert again.engine.kv_tier.stats.prefetched_blocks >= 4 * 17  # every prompt's prefix but none recomputed
    again.engine.close()
