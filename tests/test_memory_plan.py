"""KV-cache sizing by --gpu-memory-utilization: the profiling step's arrays against the
positions and slots written out plainly, the budget's arithmetic and its refusal, and an
engine on the CPU whose platform is given an allocator's counters: the profiled forward
runs at max_num_batched_tokens and the KV cache gets exactly what the formula leaves."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from engine import LLM
from engine.engine.memory_plan import MemoryBudget, budget_kv_cache, profile_arrays, profile_sequences
from engine.interfaces.platform import MemoryInfo

MiB = 2**20


def test_profile_sequences_fill_the_token_budget_up_to_max_model_len():
    assert profile_sequences(10, 4) == [4, 4, 2]
    assert profile_sequences(8, 4) == [4, 4]
    assert profile_sequences(3, 16) == [3]


def test_profile_arrays_prefill_each_sequence_from_position_zero_in_blocks_of_its_own():
    arrays = profile_arrays([5, 3], block_size=4, recurrent=False)
    assert arrays["positions"].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert arrays["query_start_loc"].tolist() == [0, 5, 8]
    assert arrays["block_tables"].tolist() == [[0, 1], [2, 0]]
    # slot = block * block_size + offset, every token of its own
    assert arrays["slot_mapping"].tolist() == [0, 1, 2, 3, 4, 8, 9, 10]
    assert arrays["context_lens"].tolist() == [0, 0] and arrays["seq_lens"].tolist() == [5, 3]
    assert arrays["max_query_len"] == 5 and arrays["state_slots"] is None
    assert profile_arrays([2, 2], 4, recurrent=True)["state_slots"].tolist() == [0, 1]
    assert len(np.unique(arrays["slot_mapping"])) == 8


def test_the_budget_is_the_share_less_what_is_in_use_and_the_peak(caplog):
    budget = MemoryBudget(
        total_bytes=80 * 2**30,
        utilization=0.9,
        in_use_bytes=20 * 2**30,
        activation_peak_bytes=4 * 2**30,
        profile_tokens=8192,
    )
    with caplog.at_level(logging.INFO, logger="engine"):
        assert budget_kv_cache(budget) == int(72 * 2**30) - 24 * 2**30
    line = caplog.messages[-1]
    for figure in (
        "80.00 GiB total",
        "utilization 0.9",
        "in use before the KV cache",
        "20.00 GiB",
        "8192 tokens",
        "4.00 GiB",
        "KV cache 48.00 GiB",
    ):
        assert figure in line


def test_no_room_left_is_refused_with_the_figures_and_what_to_change():
    budget = MemoryBudget(16 * 2**30, 0.5, 6 * 2**30, 3 * 2**30, 16384)
    with pytest.raises(
        ValueError,
        match=r"No device memory is left for the KV cache: 16\.00 GiB total .*"
        r"--gpu-memory-utilization.*--max-num-batched-tokens",
    ):
        budget_kv_cache(budget)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from engine.testing.checkpoints import make_tiny_checkpoint

    path = tmp_path_factory.mktemp("llama")
    make_tiny_checkpoint("LlamaForCausalLM", path)
    return path


class Counters:
    """A device allocator's counters, faked: the peak rises by ``activation`` bytes while a
    forward runs after a reset; every forward's token count is recorded."""

    def __init__(self, activation: int) -> None:
        self.activation = activation
        self.base = 64 * MiB
        self.peak = self.base
        self.forwards: list[int] = []
        self.logit_rows: list[int] = []


def fake_device(monkeypatch, counters: Counters, total: int, free: int) -> None:
    from engine_cpu.platform import CpuPlatform
    from engine_llama.model import LlamaForCausalLM

    monkeypatch.setattr(CpuPlatform, "memory_info", lambda self: MemoryInfo(free, total))
    monkeypatch.setattr(CpuPlatform, "memory_stats", lambda self: (counters.base, counters.peak))

    def reset(self):
        counters.peak = counters.base

    monkeypatch.setattr(CpuPlatform, "reset_peak_memory", reset)
    forward, logits = LlamaForCausalLM.forward, LlamaForCausalLM.compute_logits

    def spy_forward(self, input_ids, positions, ctx):
        counters.forwards.append(int(input_ids.shape[0]))
        counters.peak = max(counters.peak, counters.base + counters.activation)
        return forward(self, input_ids, positions, ctx)

    def spy_logits(self, hidden):
        counters.logit_rows.append(int(hidden.shape[0]))
        return logits(self, hidden)

    monkeypatch.setattr(LlamaForCausalLM, "forward", spy_forward)
    monkeypatch.setattr(LlamaForCausalLM, "compute_logits", spy_logits)


def make_llm(path, **settings) -> LLM:
    return LLM(str(path), plugins=["cpu", "llama"], dtype="float32", progress=False, block_size=4, **settings)


def kv_bytes(llm: LLM) -> int:
    return sum(t.numel() * t.element_size() for t in llm.engine.kv_cache.layer_caches)


def test_the_engine_sizes_its_cache_by_the_profiled_forward(monkeypatch, checkpoint, caplog):
    counters = Counters(activation=12 * MiB)
    fake_device(monkeypatch, counters, total=100 * MiB, free=70 * MiB)
    with caplog.at_level(logging.INFO, logger="engine"):
        llm = make_llm(checkpoint, gpu_memory_utilization=0.5, max_num_batched_tokens=96, max_num_seqs=64)
    # the profile: 96 tokens in one forward (sequences of at most max_model_len), the LM head on 64 rows
    assert counters.forwards == [96] and counters.logit_rows == [64]
    expected = 50 * MiB - 30 * MiB - 12 * MiB
    per_block = kv_bytes(llm) // llm.engine.kv_cache.num_blocks
    assert expected - per_block < kv_bytes(llm) <= expected
    assert any("KV cache 0.01 GiB" in m and "activation peak of a forward at 96 tokens" in m for m in caplog.messages)
    out = llm.generate([[5, 6, 7]], use_tqdm=False)[0].outputs[0].token_ids
    assert len(out) > 0


def test_an_activation_peak_past_the_share_is_refused(monkeypatch, checkpoint):
    counters = Counters(activation=40 * MiB)
    fake_device(monkeypatch, counters, total=100 * MiB, free=70 * MiB)
    with pytest.raises(ValueError, match="No device memory is left for the KV cache"):
        make_llm(checkpoint, gpu_memory_utilization=0.5, max_num_batched_tokens=64)


def test_an_explicit_kv_cache_size_profiles_nothing(monkeypatch, checkpoint):
    counters = Counters(activation=12 * MiB)
    fake_device(monkeypatch, counters, total=100 * MiB, free=70 * MiB)
    llm = make_llm(checkpoint, kv_cache_memory=0.004)
    assert counters.forwards == []
    assert kv_bytes(llm) <= 0.004 * 2**30


def test_platforms_without_counters_keep_their_default():
    from engine_cpu.platform import CpuPlatform

    assert CpuPlatform().memory_stats() is None
