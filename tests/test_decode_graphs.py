"""Captured decode steps (engine.runtime.graphs) on the CPU, with a stand-in for the device's
graphs that keeps capture's contract: the output tensor returned at capture is what each
replay refills, from whatever the static inputs hold then. Greedy outputs must equal the
eager engine's for batches that replay (padded or exact), batches too large for any graph,
and steps with prompt tokens."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.runtime.graphs import StaleGraph, graph_batch_sizes, padded_size


def test_batch_sizes_are_powers_of_two_to_eight_then_steps_of_eight_up_to_the_cap():
    assert graph_batch_sizes(256) == [1, 2, 4, 8, *range(16, 257, 8)]
    assert graph_batch_sizes(100) == [1, 2, 4, 8, *range(16, 97, 8), 100]
    assert graph_batch_sizes(256, 20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(3) == [1, 2, 3]
    assert graph_batch_sizes(1000)[-1] == 512  # the default cap
    with pytest.raises(ValueError, match="at least 1"):
        graph_batch_sizes(8, 0)


def test_a_batch_replays_the_smallest_graph_that_holds_it():
    sizes = graph_batch_sizes(64)
    assert [padded_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 17, 64)] == [1, 2, 4, 8, 8, 16, 24, 64]
    assert padded_size(65, sizes) is None


class FakeGraph:
    captured: list[int] = []

    def capture(self, fn):
        self.fn = fn
        self.out = fn()
        FakeGraph.captured.append(self.out.shape[0])
        return self.out

    def replay(self):
        self.out.copy_(self.fn())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from engine.testing.checkpoints import make_tiny_checkpoint

    path = tmp_path_factory.mktemp("llama")
    make_tiny_checkpoint("LlamaForCausalLM", path)
    return path


@pytest.fixture
def graphs_on_cpu(monkeypatch):
    from engine_cpu.platform import CpuPlatform

    FakeGraph.captured = []
    monkeypatch.setattr(CpuPlatform, "device_graphs", lambda self: FakeGraph)


def make_llm(path, **settings) -> LLM:
    return LLM(str(path), plugins=["cpu", "llama"], dtype="float32", progress=False, max_num_seqs=8, **settings)


def prompts(n: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 300, (int(torch.randint(2, 30, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(n)
    ]


@pytest.mark.parametrize("batch", [1, 3, 4, 6])
def test_replayed_decode_steps_give_the_eager_outputs(graphs_on_cpu, checkpoint, batch):
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    eager = make_llm(checkpoint, enforce_eager=True)
    assert eager.engine.shard.runner.graphs is None and FakeGraph.captured == []
    graphed = make_llm(checkpoint, cuda_graph_max_bs=4)
    graphs = graphed.engine.shard.runner.graphs
    assert FakeGraph.captured == [4, 2, 1]  # largest first
    assert graphed.engine.kv_cache.spare_block_ids == [graphed.engine.kv_cache.num_blocks]
    batch_prompts = prompts(batch, seed=batch)
    expected = [o.outputs[0].token_ids for o in eager.generate(batch_prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in graphed.generate(batch_prompts, params, use_tqdm=False)]
    assert got == expected
    if batch <= 4:
        assert graphs.replays >= 18  # every step after the prompt's
    else:
        assert graphs.replays == 0  # 6 rows fit no graph of at most 4


def test_requests_joining_and_leaving_mid_decode_keep_their_outputs(graphs_on_cpu, checkpoint):
    """Batches shrink and grow between padded sizes while prompts arrive: replayed and eager
    steps interleave, and the padding rows write only the spare block."""
    eager = make_llm(checkpoint, enforce_eager=True)
    graphed = make_llm(checkpoint)
    requests = [
        (p, SamplingParams(temperature=0.0, max_tokens=5 + 3 * i, ignore_eos=True))
        for i, p in enumerate(prompts(7, seed=11))
    ]

    def run(llm):
        engine, outputs = llm.engine, {}
        for i, (prompt, params) in enumerate(requests):
            engine.add_request(f"r{i}", prompt, params)
            if i % 2:
                engine.step()
        while engine.has_unfinished():
            for request in engine.step().finished:
                outputs[request.request_id] = list(request.output_token_ids)
        return outputs

    assert run(graphed) == run(eager)
    assert graphed.engine.shard.runner.graphs.replays > 0


def test_speculative_decoding_runs_eagerly(graphs_on_cpu, checkpoint, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="engine"):
        llm = make_llm(checkpoint, speculative_method="ngram", num_speculative_tokens=2)
    assert llm.engine.shard.runner.graphs is None
    assert any("decode steps run eagerly: speculative decoding" in m for m in caplog.messages)


def test_an_attention_backend_that_cannot_be_captured_runs_decode_eagerly(
    graphs_on_cpu, checkpoint, monkeypatch, caplog
):
    """A backend whose capabilities say its metadata needs the host (FlashInfer's plan, a
    gather sized on the host) turns the graphs off, and the log names it."""
    import dataclasses
    import logging

    from engine.plugins.manager import get_plugin_manager

    backend = get_plugin_manager(["cpu"]).components().attention_backends.get("cpu_paged")
    monkeypatch.setattr(backend, "capabilities", dataclasses.replace(backend.capabilities, graph_capturable=False))
    with caplog.at_level(logging.INFO, logger="engine"):
        llm = make_llm(checkpoint)
    assert llm.engine.shard.runner.graphs is None and not FakeGraph.captured
    assert any(
        "decode steps run eagerly: attention backend cpu_paged builds its step metadata" in m for m in caplog.messages
    )


class FirstUseGraph(FakeGraph):
    """Captured by the first decode step of its size; its replays go stale after ``lasting``."""

    capture_on_first_use = True
    lasting = 3

    def replay(self):
        if FirstUseGraph.lasting == 0:
            raise StaleGraph("an op made a [3] tensor, [2] when captured")
        FirstUseGraph.lasting -= 1
        super().replay()


def test_graphs_captured_on_first_use_then_stale_leave_the_tokens_as_eager(checkpoint, monkeypatch, caplog):
    """No capture at start-up; the first decode step of each size captures (its own output
    used); a replay that finds its graph stale runs that step eagerly, and every step after."""
    import logging

    from engine_cpu.platform import CpuPlatform

    FakeGraph.captured, FirstUseGraph.lasting = [], 3
    monkeypatch.setattr(CpuPlatform, "device_graphs", lambda self: FirstUseGraph)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    batch_prompts = prompts(3, seed=7)
    expected = [
        o.outputs[0].token_ids
        for o in make_llm(checkpoint, enforce_eager=True).generate(batch_prompts, params, use_tqdm=False)
    ]
    with caplog.at_level(logging.INFO, logger="engine"):
        llm = make_llm(checkpoint)
        graphs = llm.engine.shard.runner.graphs
        assert FakeGraph.captured == [] and graphs.graphs == {}
        got = [o.outputs[0].token_ids for o in llm.generate(batch_prompts, params, use_tqdm=False)]
    assert got == expected
    assert FakeGraph.captured == [4]  # the first decode step's, of 3 rows padded to 4
    assert graphs.replays == 3 and graphs.disabled and graphs.graphs == {}
    assert any("decode steps run eagerly: an op made a [3] tensor" in m for m in caplog.messages)
