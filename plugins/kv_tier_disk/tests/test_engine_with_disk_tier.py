"""The disk tier under the engine: outputs stay those of an engine without a tier while
blocks come back from disk, across a restart, and through damaged segments and a full disk."""

from __future__ import annotations

import errno
import random
from pathlib import Path

import pytest

from engine import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
BLOCK_BYTES = 4 * 512  # a block of 4 tokens of the tiny Llama's fp32 KV (512 bytes a token)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from engine.testing.checkpoints import make_tiny_checkpoint

    path = tmp_path_factory.mktemp("disk-tier") / "llama"
    make_tiny_checkpoint("LlamaForCausalLM", path)
    return str(path)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(8)
    return [[rng.randrange(3, 320) for _ in range(70)] for _ in range(6)]


@pytest.fixture(scope="module")
def reference(checkpoint, prompts):
    llm = LLM(checkpoint, plugins=["cpu", "llama"], dtype="float32", progress=False)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]


def make_llm(checkpoint: str, root: Path, block_size: int = 4) -> LLM:
    # 24 blocks of 4 tokens (tiny Llama: 512 bytes of fp32 KV a token): each prompt evicts the previous ones
    return LLM(
        checkpoint,
        plugins=["cpu", "llama", "kv_tier_disk"],
        dtype="float32",
        progress=False,
        block_size=block_size,
        max_model_len=96,
        kv_cache_memory=24 * block_size * 512 / 2**30,
        kv_tier="disk",
        kv_tier_config={"path": str(root), "capacity_gb": 0.1},
    )


def one_by_one(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [llm.generate([p], PARAMS, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


def segment_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.kvs"))


def stored_keys(root: Path) -> dict[bytes, Path]:
    """The segment file of every block under ``root`` whose payload checks out, by key."""
    from engine_kv_tier_disk.segment import read_block, read_table

    found = {}
    for path in segment_files(root):
        for entry in read_table(str(path), BLOCK_BYTES):
            read_block(str(path), entry, memoryview(bytearray(BLOCK_BYTES)))  # raises unless whole and intact
            found[entry.key] = path
    return found


def first_block_key(llm: LLM, prompt: list[int]) -> bytes:
    """The key of the block holding ``prompt``'s first tokens."""
    from engine.runtime.request import Request

    request = Request("probe", prompt, SamplingParams())
    llm.engine.kv_manager.update_hashes(request)
    return request.block_hashes[0]


def test_restart_reuses_blocks_and_damaged_segments_cost_only_their_blocks(
    checkpoint, prompts, reference, tmp_path, monkeypatch
):
    from engine_kv_tier_disk.tier import DiskKVTier

    monkeypatch.setattr(DiskKVTier, "segment_bytes", 1)  # one block a segment: each damaged file costs one block
    llm = make_llm(checkpoint, tmp_path)
    assert one_by_one(llm, prompts) == reference
    keys = [first_block_key(llm, p) for p in prompts[:3]]
    llm.engine.close()  # the cached blocks go to the tier too, and pending writes land
    # every request's 18 full blocks (70 prompt tokens and 5 computed outputs) are on disk: the
    # evicted ones and those still cached at close
    stored = stored_keys(tmp_path)
    assert len(stored) == 6 * 18 and len(segment_files(tmp_path)) == 6 * 18
    damaged = [stored[key] for key in keys]
    # damage the first block of three prompts behind the tier's back: a flipped byte, a
    # truncation (seen when the tier opens), a deletion (after it opened)
    flipped = bytearray(damaged[0].read_bytes())
    flipped[-1] ^= 0xFF
    damaged[0].write_bytes(bytes(flipped))
    damaged[1].write_bytes(damaged[1].read_bytes()[:-7])

    again = make_llm(checkpoint, tmp_path)  # a new engine, same model and layout: same digest
    damaged[2].unlink()
    assert one_by_one(again, prompts) == reference
    connector = again.engine.kv_tier
    stats = connector.tier.stats()
    assert connector.stats.prefetched_blocks == 3 * 17  # prompts 4-6 come back whole; 1-3 recompute
    assert stats.extra_counters["corrupt_blocks"] == 2 and stats.extra_counters["lost_blocks"] == 1
    assert stats.load_failures == 2  # the flipped and the deleted block (the truncated one was never listed)
    again.engine.close()
    # the damaged segments are gone; their blocks were recomputed and, evicted again, written anew and whole
    assert not any(path.exists() for path in damaged)
    assert all(key in stored_keys(tmp_path) for key in keys)


def test_blocks_stored_together_share_segments_and_all_come_back_after_a_restart(
    checkpoint, prompts, reference, tmp_path
):
    llm = make_llm(checkpoint, tmp_path)
    assert one_by_one(llm, prompts) == reference
    llm.engine.close()
    assert len(stored_keys(tmp_path)) == 6 * 18 and len(segment_files(tmp_path)) < 6 * 18

    again = make_llm(checkpoint, tmp_path)
    assert one_by_one(again, prompts) == reference
    assert again.engine.kv_tier.stats.prefetched_blocks == 6 * 17
    stats = again.engine.kv_tier.tier.stats()
    assert stats.load_failures == stats.extra_counters["corrupt_blocks"] == stats.extra_counters["lost_blocks"] == 0
    again.engine.close()


def test_another_layout_never_sees_the_blocks(checkpoint, prompts, reference, tmp_path):
    llm = make_llm(checkpoint, tmp_path)
    one_by_one(llm, prompts)
    llm.engine.close()
    stored = len(segment_files(tmp_path))
    # another block size makes another digest: none of the first engine's blocks may come back
    # (with the same digest, every prompt of this pass would start from the disk)
    other = make_llm(checkpoint, tmp_path, block_size=8)
    assert one_by_one(other, prompts) == reference
    assert other.engine.kv_tier.stats.prefetched_blocks == 0
    other.engine.close()
    assert len(segment_files(tmp_path)) > stored  # the first digest's files are still there, beside the new ones


def test_a_full_disk_costs_stores_never_requests(checkpoint, prompts, reference, tmp_path, monkeypatch):
    from engine_kv_tier_disk.tier import DiskKVTier

    def disk_full(self, path, data):
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(DiskKVTier, "_write_file", disk_full)
    llm = make_llm(checkpoint, tmp_path)
    assert one_by_one(llm, prompts) == reference
    assert one_by_one(llm, prompts) == reference
    tier = llm.engine.kv_tier.tier
    llm.engine.close()
    assert tier.stats().store_failures >= 5 * 17
    assert segment_files(tmp_path) == [] and [p for p in tmp_path.rglob("*") if p.is_file() and p.name != ".lock"] == []
