"""The KV tier contract, the built-in cpu tier, and the engine's offload / prefetch through it."""

from __future__ import annotations

import json
import logging
import random
import sys
import textwrap

import pytest
import torch

from engine import LLM, SamplingParams
from engine.interfaces.kv_tier import KVTierSpec
from engine.kv_tiers.cpu import CpuKVTier

SPEC = KVTierSpec("d" * 32, "float32", 4, ((4, 2, 8), (4, 2, 8)))  # 2 layers: 2 * 2 * 4 * 2 * 8 = 256 elements


def block(value: float) -> torch.Tensor:
    return torch.full((SPEC.block_numel,), float(value))


def test_spec_sizes_a_canonical_block():
    assert SPEC.block_numel == 256 and SPEC.block_bytes == 1024


def test_cpu_tier_store_lookup_load_and_partial_load():
    tier = CpuKVTier(SPEC, {"capacity_gb": 1})
    keys = [bytes([i]) * 16 for i in range(4)]
    assert tier.store(keys[:3], [block(i) for i in range(3)]).result() == [True] * 3
    assert tier.lookup(keys) == 3 and tier.lookup(keys[1:]) == 2 and tier.lookup(keys[3:]) == 0
    out = [torch.empty(SPEC.block_numel) for _ in range(4)]
    # a key the tier does not hold fails alone; the others load
    assert tier.load([keys[0], keys[3], keys[2]], out[:3]).result() == [True, False, True]
    assert torch.equal(out[0], block(0)) and torch.equal(out[2], block(2))
    stats = tier.stats()
    assert (stats.stored_blocks, stats.loaded_blocks, stats.load_failures) == (3, 2, 1)
    assert stats.bytes_written == 3 * 1024 and stats.bytes_read == 2 * 1024
    assert stats.hits == 3 + 2 + 0 and stats.misses == 3  # the lookups above: each that stopped short misses once


def test_cpu_tier_keeps_its_own_copy():
    tier = CpuKVTier(SPEC, {})
    given = block(7.0)
    tier.store([b"k" * 16], [given])
    given.fill_(0)
    out = torch.empty(SPEC.block_numel)
    assert tier.load([b"k" * 16], [out]).result() == [True] and torch.equal(out, block(7.0))


def test_cpu_tier_evicts_least_recently_used_at_capacity():
    tier = CpuKVTier(SPEC, {"capacity_gb": 3 * 1024 / 2**30})  # three blocks
    keys = [bytes([i]) * 16 for i in range(5)]
    tier.store(keys[:3], [block(i) for i in range(3)])
    tier.load([keys[0]], [torch.empty(SPEC.block_numel)])  # key 0 becomes the most recently used
    tier.store(keys[3:4], [block(3)])  # evicts key 1
    assert [tier.lookup([k]) for k in keys[:4]] == [1, 0, 1, 1]
    assert tier.stats().evicted_blocks == 1 and tier.stats().extra["blocks"] == 3


def test_cpu_tier_counts_a_lookup_hit_as_a_use():
    tier = CpuKVTier(SPEC, {"capacity_gb": 3 * 1024 / 2**30})  # three blocks
    keys = [bytes([i]) * 16 for i in range(5)]
    tier.store(keys[:3], [block(i) for i in range(3)])
    assert tier.lookup([keys[0], keys[3]]) == 1  # key 0 found (a use); the lookup stops at key 3
    tier.store(keys[3:4], [block(3)])  # evicts key 1, the least recently used
    assert [tier.lookup([k]) for k in keys[:4]] == [1, 0, 1, 1]


def test_cpu_tier_refuses_a_block_of_another_shape_and_is_closed_for_good():
    tier = CpuKVTier(SPEC, {})
    assert tier.store([b"x" * 16], [torch.zeros(5)]).result() == [False]
    assert tier.stats().store_failures == 1
    tier.close()
    with pytest.raises(RuntimeError, match="closed"):
        tier.lookup([b"x" * 16])


@pytest.mark.parametrize(
    "config,message",
    [
        ({"capacity_gb": -1}, "'capacity_gb' must be a number above 0, got -1"),
        ({"capacity_gb": "lots"}, "'capacity_gb' must be a number above 0, got 'lots'"),
        ({"capacity_gb": 1e-9}, "holds no block of 1024 bytes"),
        ({"path": "/tmp"}, "unknown config key(s) 'path'; it takes 'capacity_gb'"),
    ],
)
def test_cpu_tier_bad_config_is_a_clear_error(config, message):
    with pytest.raises(ValueError) as info:
        CpuKVTier(SPEC, config)
    assert message in str(info.value)


# -------------------------------------------------------------------------
# in the engine
# -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from engine.testing.checkpoints import make_tiny_checkpoint

    path = tmp_path_factory.mktemp("tier") / "llama"
    make_tiny_checkpoint("LlamaForCausalLM", path)
    return str(path)


PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def prompts(n: int = 6, length: int = 70) -> list[list[int]]:
    rng = random.Random(4)
    return [[rng.randrange(3, 320) for _ in range(length)] for _ in range(n)]


def make_llm(checkpoint: str, **kwargs) -> LLM:
    # 24 blocks of 4 tokens: the prompts evict each other's prefixes
    return LLM(
        checkpoint,
        plugins=["cpu", "llama"],
        dtype="float32",
        progress=False,
        block_size=4,
        max_model_len=96,
        kv_cache_memory=24 * kwargs.pop("bytes_per_block", 0) / 2**30 or None,
        **kwargs,
    )


def tokens(llm: LLM, batch: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(batch, PARAMS, use_tqdm=False)]


def bytes_per_block(checkpoint: str) -> int:
    llm = LLM(checkpoint, plugins=["cpu", "llama"], dtype="float32", progress=False, block_size=4)
    specs = llm.engine.model.kv_cache_specs()
    return 4 * sum(s.kv_bytes_per_token(4) for s in specs)


def test_outputs_identical_with_blocks_coming_back_from_the_tier(checkpoint):
    batch = prompts()
    reference = tokens(LLM(checkpoint, plugins=["cpu", "llama"], dtype="float32", progress=False), batch)
    llm = make_llm(checkpoint, bytes_per_block=bytes_per_block(checkpoint), kv_tier="cpu")
    engine = llm.engine
    assert engine.kv_cache.num_blocks == 24
    first = [tokens(llm, [p])[0] for p in batch]  # one at a time: each evicts the previous prefixes
    assert engine.kv_tier.stats.offered_blocks > 0
    again = [tokens(llm, [p])[0] for p in batch]  # the prefixes come back from the tier
    assert first == reference and again == reference
    assert engine.kv_tier.stats.prefetched_blocks >= 5 * 17  # all but the last prompt's 17 full blocks
    assert engine.kv_manager.num_free_blocks == engine.kv_cache.num_blocks
    llm.engine.close()


FLAKY_TIER = textwrap.dedent('''
    from concurrent.futures import Future
    from engine.kv_tiers.cpu import CpuKVTier

    class FlakyTier(CpuKVTier):
        """Fails every other block of a load, like a tier whose copies went bad."""
        name = "flaky"

        def load(self, keys, into):
            results = self.load_all(keys, into)
            future = Future()
            future.set_result([ok and i % 2 == 0 for i, ok in enumerate(results)])
            return future

        def load_all(self, keys, into):
            return super().load(keys, into).result()
''')


def test_partial_loads_fall_back_to_recompute_with_identical_outputs(checkpoint, tmp_path, monkeypatch):
    (tmp_path / "flaky_tier_module.py").write_text(FLAKY_TIER)
    monkeypatch.syspath_prepend(str(tmp_path))
    batch = prompts()
    reference = tokens(LLM(checkpoint, plugins=["cpu", "llama"], dtype="float32", progress=False), batch)
    llm = make_llm(checkpoint, bytes_per_block=bytes_per_block(checkpoint), kv_tier="flaky_tier_module:FlakyTier")
    first = [tokens(llm, [p])[0] for p in batch]
    again = [tokens(llm, [p])[0] for p in batch]
    stats = llm.engine.kv_tier.stats
    assert first == reference and again == reference
    # each load returned its first block and failed the second: one block per prompt came back
    assert stats.prefetched_blocks >= 5 and stats.prefetch_failures >= 5
    sys.modules.pop("flaky_tier_module", None)


RAISING_TIER = textwrap.dedent('''
    from concurrent.futures import Future
    from engine.kv_tiers.cpu import CpuKVTier

    class RaisingTier(CpuKVTier):
        """Breaks in every way a tier can: lookups and loads raise, and every other store
        raises in the call or fails its future."""
        name = "raising"
        calls = 0

        def lookup(self, keys):
            raise OSError("lookup: device gone")

        def store(self, keys, blocks):
            RaisingTier.calls += 1
            if RaisingTier.calls % 2:
                raise OSError("store: device gone")
            future = Future()
            future.set_exception(OSError("store future: device gone"))
            return future
''')


def test_a_tier_that_raises_costs_a_recompute_never_a_request(checkpoint, tmp_path, monkeypatch, caplog):
    (tmp_path / "raising_tier_module.py").write_text(RAISING_TIER)
    monkeypatch.syspath_prepend(str(tmp_path))
    batch = prompts()
    reference = tokens(LLM(checkpoint, plugins=["cpu", "llama"], dtype="float32", progress=False), batch)
    llm = make_llm(checkpoint, bytes_per_block=bytes_per_block(checkpoint), kv_tier="raising_tier_module:RaisingTier")
    with caplog.at_level(logging.WARNING, logger="engine"):
        first = [tokens(llm, [p])[0] for p in batch]
        again = [tokens(llm, [p])[0] for p in batch]
    assert first == reference and again == reference
    messages = [r.getMessage() for r in caplog.records]
    for what in ("a lookup", "a store"):
        assert any(f"KV tier 'raising' failed {what} of" in m for m in messages), what
    assert any("OSError: store future: device gone" in m for m in messages)
    assert llm.engine.kv_tier.stats.prefetched_blocks == 0
    sys.modules.pop("raising_tier_module", None)


def test_tier_selection_errors_are_clear(checkpoint):
    with pytest.raises(ValueError, match="kv_tier_config was given without kv_tier"):
        LLM(checkpoint, plugins=["cpu", "llama"], progress=False, kv_tier_config={"capacity_gb": 1})
    with pytest.raises(ValueError, match="it needs prefix caching on"):
        LLM(checkpoint, plugins=["cpu", "llama"], progress=False, kv_tier="cpu", enable_prefix_caching=False)
    with pytest.raises(ValueError, match="'capacity_gb' must be a number above 0"):
        LLM(checkpoint, plugins=["cpu", "llama"], progress=False, kv_tier="cpu", kv_tier_config='{"capacity_gb": 0}')
    with pytest.raises(ValueError, match="kv_tier_config is not valid JSON"):
        LLM(checkpoint, plugins=["cpu", "llama"], progress=False, kv_tier="cpu", kv_tier_config="{capacity_gb: 1}")
    with pytest.raises(Exception, match="Unknown KV tier 'nvme'"):
        LLM(checkpoint, plugins=["cpu", "llama"], progress=False, kv_tier="nvme")


def test_the_cpu_tier_needs_no_plugin(checkpoint):
    from engine.plugins.manager import get_plugin_manager

    tiers = get_plugin_manager("").components().kv_tiers
    assert tiers.get("cpu") is CpuKVTier


def test_default_gather_and_scatter_serve_slot_major_layouts():
    from engine.interfaces.attention import MHA, AttentionSpec
    from engine_example_plugins.attention import TorchPagedAttention

    spec = AttentionSpec(kind=MHA, num_heads=4, num_kv_heads=2, head_size=8, scale=0.3)
    backend = TorchPagedAttention(spec, 4, torch.float32, torch.device("cpu"))
    cache = torch.zeros(backend.kv_cache_shape(5))
    slots = torch.tensor([0, 5, 19])
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    backend.scatter_kv(cache, slots, k, v)
    assert torch.equal(cache[0, 5], k[1]) and torch.equal(cache[1, 19], v[2])  # the layout's own indexing
    got_k, got_v = backend.gather_kv(cache, slots)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    assert cache.count_nonzero() == k.count_nonzero() + v.count_nonzero()


def test_cli_parses_the_tier_config_as_json():
    from engine.config import EngineConfig

    config = EngineConfig(model="x", kv_tier="cpu", kv_tier_config=json.dumps({"capacity_gb": 2}))
    assert config.kv_tier_config == {"capacity_gb": 2}
    with pytest.raises(ValueError, match="must be a JSON object"):
        EngineConfig(model="x", kv_tier="cpu", kv_tier_config="[1, 2]")
