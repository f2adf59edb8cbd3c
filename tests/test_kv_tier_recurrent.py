"""KV tiers carry the recurrent-state snapshots of hybrid models (Kimi Linear's KDA, Qwen3.5's
gated DeltaNet, Nemotron-H's Mamba-2 beside their attention layers): prefixes go to the cpu and
disk tiers with the snapshots at their block boundaries and come back, in the same engine and in
a new one started on the same directory, with the greedy outputs of an engine without a tier. A
prefix resumes only at a boundary whose snapshot came back with it."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.testing import recurrent
from engine.testing.generation import greedy_tokens, random_prompts

BLOCK = 8
INTERVAL = 32  # snapshots after blocks 4 and 8 (tokens 32, 64), and at each prompt's last full block
PROMPT = 75  # its last full block is block 9 (tokens 64..71): 9 blocks a prefix hit may cover
NEW_TOKENS = 6
MODELS = {
    "KimiLinearForCausalLM": "kimi_k3",
    "Qwen3_5ForCausalLM": "qwen",
    "NemotronHForCausalLM": "nemotron_h",
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request, tmp_path_factory) -> tuple[Path, list[str]]:
    return tiny_model(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def kimi_linear(tmp_path_factory) -> tuple[Path, list[str]]:
    return tiny_model("KimiLinearForCausalLM", tmp_path_factory)


def tiny_model(architecture: str, tmp_path_factory) -> tuple[Path, list[str]]:
    from engine.testing.checkpoints import make_tiny_checkpoint

    path = tmp_path_factory.mktemp(architecture)
    make_tiny_checkpoint(architecture, path)
    return path, ["cpu", MODELS[architecture]]


def make_llm(model: tuple[Path, list[str]], *more_plugins: str, **kwargs):
    path, plugins = model
    settings = {"block_size": BLOCK, "state_snapshot_interval": INTERVAL, **kwargs}
    return recurrent.make_llm(path, [*plugins, *more_plugins], **settings)


def one_by_one(llm, prompts: list[list[int]]) -> list[list[int]]:
    return [greedy_tokens(llm, [p], NEW_TOKENS)[0] for p in prompts]


def block_hashes(llm, prompt: list[int]) -> list[bytes]:
    from engine import SamplingParams
    from engine.runtime.request import Request

    request = Request("probe", prompt, SamplingParams())
    llm.engine.kv_manager.update_hashes(request)
    return request.block_hashes


def snapshot(llm, h: bytes):
    """The state kept after the block with hash ``h``: every recurrent layer's row, one after another."""
    import torch

    row = llm.engine.kv_manager.snapshots[h]
    kv_cache = llm.engine.shard.runner.kv_cache
    caches = [c for c, b in zip(kv_cache.layer_caches, kv_cache.layer_backends) if b.spec.is_recurrent]
    return torch.cat([cache[row].reshape(-1) for cache in caches])


def same_snapshots(llm, plain, prompts: list[list[int]], block: int) -> int:
    """How many of the prompts' snapshots after ``block`` ``llm`` holds; each must have the bits
    of the one ``plain`` (an engine without a tier that ran the same prompts) computed."""
    import torch

    held = 0
    for prompt in prompts:
        h = block_hashes(plain, prompt)[block - 1]
        if h in llm.engine.kv_manager.snapshots:
            assert torch.equal(snapshot(llm, h).view(torch.int32), snapshot(plain, h).view(torch.int32))
            held += 1
    return held


def segments_by_key(root: Path, block_bytes: int) -> dict[bytes, Path]:
    from engine_kv_tier_disk.segment import read_table

    return {entry.key: path for path in root.rglob("*.kvs") for entry in read_table(str(path), block_bytes)}


def test_the_tier_spec_holds_the_attention_blocks_and_the_recurrent_states(kimi_linear):
    # the tiny Kimi Linear: KDA layers 0, 1 and 3 (4 heads of 16, convolutions of 4 taps) and an
    # MLA layer 2 caching one entry a token (latent 32 and rope 8), float32
    llm = make_llm(kimi_linear, kv_tier="cpu")
    spec = llm.engine.kv_tier.spec
    assert spec.layer_shapes == ((BLOCK, 1, 32 + 8),) and spec.keys_only == (0,)
    kda = (4 - 1) * 4 * (16 + 16 + 16) + 4 * 16 * 16  # the inputs of q, k and v kept, then S [H, dk, dv]
    assert spec.state_numels == (kda, kda, kda)
    assert (spec.block_bytes, spec.state_bytes) == (BLOCK * 40 * 4, 3 * kda * 4)
    assert spec.state_blocks == 15  # 19200 bytes in parts of 1280
    llm.engine.close()


def test_prefixes_and_their_snapshots_come_back_from_the_disk_tier_after_a_restart(model, tmp_path, monkeypatch):
    from engine_kv_tier_disk.tier import DiskKVTier

    monkeypatch.setattr(DiskKVTier, "segment_bytes", 1)  # a block a segment: one snapshot part can be lost alone
    prompts = random_prompts(11, lengths=(PROMPT,) * 4)
    plain = make_llm(model)
    reference = one_by_one(plain, prompts)
    tier = {"kv_tier": "disk", "kv_tier_config": {"path": str(tmp_path), "capacity_gb": 0.1}}

    first = make_llm(model, "kv_tier_disk", **tier)
    assert one_by_one(first, prompts) == reference
    spec = first.engine.kv_tier.spec
    assert spec.state_numels and spec.state_blocks > 1
    hashes = block_hashes(first, prompts[0])
    first.engine.close()  # every cached block and snapshot goes to the disk
    stored = segments_by_key(tmp_path, spec.block_bytes)
    for prompt in prompts:  # the snapshots after blocks 4, 8 and 9 of every prompt, whole
        for block in (4, 8, 9):
            assert all(k in stored for k in spec.state_keys(block_hashes(first, prompt)[block - 1]))
    # the snapshot at prompt 0's end loses a part: that prompt resumes after block 8, never at block 9
    stored[spec.state_keys(hashes[8])[-1]].unlink()
    # one at prompt 1's end is damaged (the tier lists it, its load fails): prompt 1 resumes after block 8
    damaged = stored[spec.state_keys(block_hashes(first, prompts[1])[8])[0]]
    flipped = bytearray(damaged.read_bytes())
    flipped[-1] ^= 0xFF
    damaged.write_bytes(bytes(flipped))

    again = make_llm(model, "kv_tier_disk", **tier)
    assert again.engine.kv_tier.spec == spec  # same model and layout: same digest
    assert one_by_one(again, prompts) == reference
    connector, manager = again.engine.kv_tier, again.engine.kv_manager
    assert connector.stats.prefetched_states == 4
    assert connector.stats.prefetched_blocks == 8 + 3 * 9  # prompt 1's block 9 too, before its snapshot failed
    assert manager.snapshot_stats.restored == 4
    assert manager.stats.hits == (8 + 8 + 2 * 9) * BLOCK  # the cached tokens the requests started from
    # the states the requests started from (prompt 0's after block 8), and those they kept at
    # their prompt's end, are those of the engine without a tier, bit for bit
    assert same_snapshots(again, plain, prompts[:2], 8) == 2
    assert same_snapshots(again, plain, prompts, 9) == 4
    stats = connector.tier.stats()
    # every prompt's snapshot, and prompt 1's after block 8 beside all but one part of its last
    assert stats.loaded_blocks == 8 + 3 * 9 + 5 * spec.state_blocks - 1 and stats.load_failures == 1
    again.engine.close()


def test_cpu_tier_under_eviction_keeps_outputs_and_resumes_at_snapshots_only(kimi_linear):
    model = kimi_linear
    prompts = random_prompts(12, lengths=(PROMPT,) * 4)
    plain = make_llm(model)
    reference = one_by_one(plain, prompts)
    # a conversation's next turn: each prompt, its answer and more tokens; its cached blocks go
    # past the prompt's last snapshot (block 10 holds the answer's first tokens), not its snapshots
    turns = [p + out + extra for p, out, extra in zip(prompts, reference, random_prompts(13, lengths=(10,) * 4))]
    reference_turns = one_by_one(plain, turns)
    # 24 blocks, 2 request slots and 4 snapshot rows: each prompt evicts the blocks and snapshots of
    # the one before last; snapshots also go when a newer one needs their row
    memory = recurrent.state_and_block_bytes(plain, 2 + 4, 24, BLOCK)
    llm = make_llm(
        model,
        kv_cache_memory=memory / 2**30,
        max_num_seqs=2,
        num_state_snapshots=4,
        max_model_len=128,
        kv_tier="cpu",
        kv_tier_config={"capacity_gb": 0.1},
    )
    connector, manager = llm.engine.kv_tier, llm.engine.kv_manager
    assert manager.num_blocks == 24
    assert one_by_one(llm, prompts) == reference
    assert connector.stats.offered_states > 0 and connector.stats.prefetched_states == 0
    assert one_by_one(llm, prompts) == reference  # every prompt's prefix is in the tier by now
    assert connector.stats.prefetched_states == 4 and connector.stats.prefetched_blocks == 4 * 9
    assert same_snapshots(llm, plain, prompts, 9) >= 1
    loaded = connector.stats.prefetched_blocks
    assert one_by_one(llm, turns) == reference_turns
    # a turn resumes at its prompt's last snapshot (block 9) at the furthest: block 10, in the tier
    # or the primary cache, has none, and the turns' own snapshots are not taken before they run
    assert connector.stats.prefetched_blocks - loaded <= 4 * 9
    assert manager.snapshot_stats.restored >= 8
    assert connector.tier.stats().loaded_blocks > 0
    llm.engine.close()


@pytest.mark.parametrize("architecture", ["KimiLinearForCausalLM", "Qwen3_5ForCausalLM", "NemotronHForCausalLM"])
@pytest.mark.parametrize(("store_tp", "load_tp"), [(2, 1), (1, 2)])
def test_snapshots_stored_under_one_rank_count_restore_under_the_other(
    architecture, store_tp, load_tp, tmp_path_factory, tmp_path
):
    """The disk tier keeps each snapshot whole (every head's state; Mamba-2's B and C of every
    group): what two ranks stored (each its heads, or its group of Nemotron-H's two) one rank
    resumes from, and the other way round, with the outputs of an engine without a tier."""
    model = tiny_model(architecture, tmp_path_factory)
    prompts = random_prompts(13, lengths=(PROMPT,) * 3)
    reference = one_by_one(make_llm(model), prompts)
    tier = {"kv_tier": "disk", "kv_tier_config": {"path": str(tmp_path), "capacity_gb": 0.1}}

    def run(tp: int):
        llm = make_llm(model, "kv_tier_disk", tensor_parallel_size=tp, **tier)
        outputs = one_by_one(llm, prompts)
        spec, stats = llm.engine.kv_tier.spec, llm.engine.kv_tier.stats
        llm.engine.close()  # every cached block and snapshot goes to the disk
        return outputs, spec, stats

    stored, stored_spec, _ = run(store_tp)
    loaded, loaded_spec, stats = run(load_tp)
    assert stored == reference and loaded == reference
    assert loaded_spec == stored_spec  # whole heads and groups: one digest for both rank counts
    assert stats.prefetched_states == len(prompts)  # each prompt resumed at its last snapshot
    assert stats.prefetched_blocks == len(prompts) * (PROMPT // BLOCK)


@pytest.mark.parametrize("groups", [2, 1])
def test_each_rank_s_part_of_a_state_lies_where_its_heads_and_groups_are(groups):
    """AttentionSpec.state_placement against the split written out: rank r of 2 holds heads
    4r..4r+3 of 8: their channels of each convolution section (linear attention's q, k, v;
    Mamba-2's x) and their rows of the recurrent matrix, and Mamba-2's B and C of group r of 2
    (of the one group, on both ranks)."""
    from engine.interfaces.attention import LINEAR, MAMBA2, AttentionSpec

    dk, dv, hd, ds = 3, 5, 2, 7
    linear = AttentionSpec(LINEAR, 4, 4, dk, 1.0, value_size=dv, conv_kernel=4, total_num_heads=8)
    for rank in (0, 1):
        runs, first_head = linear.state_placement(rank)
        assert first_head == 4 * rank
        assert runs == [
            (4 * rank * dk, 0, 4 * dk),
            (8 * dk + 4 * rank * dk, 4 * dk, 4 * dk),
            (16 * dk + 4 * rank * dv, 8 * dk, 4 * dv),
        ]
    assert linear.canonical_state_numel() == 3 * 8 * (2 * dk + dv) + 8 * dk * dv
    local_groups = groups // 2 or 1
    mamba = AttentionSpec(
        MAMBA2,
        4,
        4,
        hd,
        1.0,
        conv_kernel=4,
        state_size=ds,
        num_groups=local_groups,
        total_num_heads=8,
        total_num_groups=groups,
    )
    for rank in (0, 1):
        runs, first_head = mamba.state_placement(rank)
        group = rank if groups == 2 else 0
        x_all = 8 * hd
        assert first_head == 4 * rank
        assert runs == [
            (4 * rank * hd, 0, 4 * hd),
            (x_all + group * ds, 4 * hd, ds),
            (x_all + groups * ds + group * ds, 4 * hd + ds, ds),
        ]
    assert mamba.canonical_state_numel() == 3 * (8 * hd + 2 * groups * ds) + 8 * hd * ds
