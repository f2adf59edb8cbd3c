"""Recorded decode forwards (engine_cpu.graphs): a replay must compute what running the
function again would, from whatever its inputs hold then; a forward a replay could not
repeat must be refused with its output intact; and an engine whose decode steps replay must
give the tokens of the same engine run eagerly."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import threading
import types

import pytest
import torch
from torch.utils._python_dispatch import _disable_current_modes

from engine import LLM, SamplingParams
from engine.runtime.graphs import StaleGraph, UncapturableStep
from engine_cpu import graphs as cpu_graphs
from engine_cpu import native
from engine_cpu.graphs import CpuGraph


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.fixture
def kernels():
    k = native.load()
    if k is None:
        pytest.skip("no native kernels here")
    return k


@torch.inference_mode()
def test_a_replay_recomputes_kernels_and_ops_from_the_inputs_current_values(kernels):
    """Functional ops, in-place ops, ops that copy or alias by layout (contiguous of a column
    slice), a dtype conversion and a native kernel writing into an allocated tensor: after
    the inputs change, a replay's output is the function's on the new values."""
    torch.manual_seed(0)
    x = torch.randn(6, 24)
    weight = torch.randn(8)

    def fn():
        cols = x[:, 4:12].contiguous()  # a copy: a column slice is not contiguous
        scaled = (cols * 2.0).to(torch.float32)
        out = torch.empty_like(scaled)
        kernels.rms_norm(out, scaled, weight, 1e-6)
        out.add_(x[:, :8])
        return torch.cat([out, x[:, 20:]], dim=1)

    graph = CpuGraph()
    captured = graph.capture(fn)
    torch.testing.assert_close(captured, fn())
    for _ in range(2):
        x.copy_(torch.randn(6, 24))
        graph.replay()
        expected = torch.cat([reference_rms_norm(x[:, 4:12] * 2.0, weight, 1e-6) + x[:, :8], x[:, 20:]], dim=1)
        torch.testing.assert_close(captured, expected, rtol=1e-5, atol=1e-5)


def test_a_capture_leaves_torch_dynamo_unimported():
    """A dispatch mode's __torch_dispatch__ is wrapped by torch._dynamo.disable unless the mode
    opts out, and the wrapper imports torch._dynamo (and triton, where installed) at its first
    op: most of a second inside the first decode step a server captures. In a fresh process, a
    capture and a replay must leave it unimported."""
    script = textwrap.dedent(
        """
        import sys
        import torch
        from engine_cpu.graphs import CpuGraph

        x = torch.randn(4, 8)
        graph = CpuGraph()
        with torch.inference_mode():
            out = graph.capture(lambda: (x[:, 2:6] * 2.0).relu())
            x.copy_(torch.randn(4, 8))
            graph.replay()
        assert torch.equal(out, (x[:, 2:6] * 2.0).relu()), "the replay did not recompute"
        print("torch._dynamo" in sys.modules)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


@pytest.mark.parametrize(
    "read",
    [
        pytest.param(lambda t: t.tolist(), id="tolist"),
        pytest.param(lambda t: t.numpy(), id="numpy"),
        pytest.param(lambda t: t.sum().item(), id="item"),
        pytest.param(lambda t: bool((t > 0).any()), id="bool"),
        pytest.param(lambda t: t.nonzero(), id="nonzero"),
        pytest.param(lambda t: t[t > 0], id="boolean-index"),
        pytest.param(lambda t: torch.repeat_interleave(t.long().abs()), id="repeat-interleave"),
    ],
)
@torch.inference_mode()
def test_a_forward_that_reads_values_on_the_host_is_refused_with_its_output(read):
    x = torch.tensor([1.0, -2.0, 3.0])

    def fn():
        read(x)
        return x * 3

    with pytest.raises(UncapturableStep) as refused:
        CpuGraph().capture(fn)
    assert refused.value.output.tolist() == [3.0, -6.0, 9.0]


@torch.inference_mode()
def test_a_native_kernel_that_returns_a_tensor_is_replayed_into_the_recorded_one(monkeypatch):
    """Kernels such as group_quant_matmul return a new tensor: the replay copies each new
    result into the tensor the capture handed on; a query with no tensor argument is not
    recorded, and one returning a number to the host refuses the capture."""
    calls = []

    def matmul(a, b):
        calls.append("matmul")
        return a @ b

    def supported(size):
        calls.append("supported")
        return size > 0

    def count(a):
        return len(a)

    module = types.SimpleNamespace(matmul=matmul, supported=supported, count=count)
    monkeypatch.setattr(native, "loaded_modules", lambda: [module])
    a, b = torch.randn(3, 4), torch.randn(4, 2)

    def fn():
        assert module.supported(4)
        return module.matmul(a, b) + 1

    graph = CpuGraph()
    out = graph.capture(fn)
    assert module.matmul is matmul  # restored after the capture
    a.copy_(torch.randn(3, 4))
    calls.clear()
    graph.replay()
    assert calls == ["matmul"]
    torch.testing.assert_close(out, a @ b + 1)
    with pytest.raises(UncapturableStep, match="native count returns a value"):
        CpuGraph().capture(lambda: a * module.count(a))


@torch.inference_mode()
def test_a_replay_whose_op_changes_its_output_shape_is_stale(monkeypatch):
    """A kernel the capture cannot look into (a library's custom op, here a native) shaping its
    output by values: a replay that gets another shape stops instead of broadcasting it into
    the recorded tensor; the same shape with new values replays."""

    def positives(a):
        with _disable_current_modes():  # compiled code: no aten op of its own is seen
            return a[a > 0].clone()

    module = types.SimpleNamespace(positives=positives)
    monkeypatch.setattr(native, "loaded_modules", lambda: [module])
    a = torch.tensor([1.0, -1.0, 2.0])
    graph = CpuGraph()
    out = graph.capture(lambda: module.positives(a) * 2)
    a.copy_(torch.tensor([-3.0, 4.0, 5.0]))
    graph.replay()
    assert out.tolist() == [8.0, 10.0]
    a.copy_(torch.tensor([-3.0, -4.0, 5.0]))
    with pytest.raises(StaleGraph, match=r"positives made a \[1\] tensor, \[2\] when captured"):
        graph.replay()


@torch.inference_mode()
def test_another_threads_ops_during_a_capture_are_not_recorded(kernels):
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    started, release = threading.Event(), threading.Event()

    def other():
        started.set()
        release.wait()
        with torch.inference_mode():  # a thread's own mode
            kernels.rms_norm(y, y.clone(), torch.ones(8), 1e-6)
            y.mul_(2)

    def fn():
        thread = threading.Thread(target=other)
        thread.start()
        started.wait()
        release.set()
        thread.join()
        return x + 1

    graph = CpuGraph()
    graph.capture(fn)
    assert len(graph.tape) == 1
    assert graph.tape[0][0] is torch.ops.aten.add.Tensor


def test_captures_in_two_threads_each_record_their_own_forward(kernels):
    """Engines capturing at once (one process, two threads) take turns: each tape holds its own
    forward, and the kernel modules end with their own functions again."""
    before = {name: getattr(kernels, name) for name in dir(kernels) if not name.startswith("_")}
    graphs, outputs = {}, {}
    weight = torch.ones(8)

    def capture(key: int) -> None:
        with torch.inference_mode():
            x = torch.full((2, 8), float(key + 1))
            out = torch.empty_like(x)

            def fn():
                kernels.rms_norm(out, x, weight, 1e-6)
                return out * (key + 2)

            graphs[key] = CpuGraph()
            outputs[key] = (x, graphs[key].capture(fn))

    threads = [threading.Thread(target=capture, args=(key,)) for key in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert {name: getattr(kernels, name) for name in before} == before
    with torch.inference_mode():
        for key, (x, out) in outputs.items():
            assert len(graphs[key].tape) == 2
            x.copy_(torch.randn(2, 8))
            graphs[key].replay()
            torch.testing.assert_close(out, reference_rms_norm(x, weight, 1e-6) * (key + 2), rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_graphs_past_the_memory_budget_are_refused(monkeypatch):
    monkeypatch.setattr(CpuGraph, "memory_budget", classmethod(lambda cls: CpuGraph._held + 1024))
    x = torch.randn(64, 64)
    with pytest.raises(UncapturableStep, match="MiB of activations"):
        CpuGraph().capture(lambda: x @ x)
    kept = CpuGraph()
    monkeypatch.setattr(CpuGraph, "memory_budget", classmethod(lambda cls: CpuGraph._held + 2**20))
    held = CpuGraph._held
    kept.capture(lambda: x @ x)
    assert CpuGraph._held == held + 64 * 64 * 4
    del kept
    assert CpuGraph._held == held


# the engine


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from engine.testing.checkpoints import make_tiny_checkpoint

    path = tmp_path_factory.mktemp("llama")
    make_tiny_checkpoint("LlamaForCausalLM", path)
    return path


def make_llm(path, dtype, **settings) -> LLM:
    return LLM(str(path), plugins=["cpu", "llama"], dtype=dtype, progress=False, max_num_seqs=16, **settings)


def prompts(n: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 300, (int(torch.randint(2, 40, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(n)
    ]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_engine_replays_decode_steps_with_the_eager_tokens(checkpoint, dtype, kernels):
    """Sequences of different lengths finishing at different steps: the batch shrinks through
    padded sizes, each captured by its first step and replayed after."""
    requests = [
        (p, SamplingParams(temperature=0.0, max_tokens=4 + 3 * i, ignore_eos=True))
        for i, p in enumerate(prompts(9, seed=3))
    ]
    eager = make_llm(checkpoint, dtype, enforce_eager=True)
    graphed = make_llm(checkpoint, dtype)
    graphs = graphed.engine.shard.runner.graphs
    assert graphs is not None and graphs.graphs == {}  # nothing captured at start-up
    expected = [o.outputs[0].token_ids for o in eager.generate(*zip(*requests), use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in graphed.generate(*zip(*requests), use_tqdm=False)]
    assert got == expected
    # 9 rows pad to 16, then 8 to 5 rows to 8, 4 and 3 to 4, 2, 1: the first step of each size
    # captures its graph, every other step after the prompts' replays one
    assert set(graphs.graphs) == {16, 8, 4, 2, 1}
    decode_steps = max(len(t) for t in expected) - 1
    assert graphs.replays == decode_steps - len(graphs.graphs)


def test_greedy_steps_take_the_models_picks_and_others_the_logits(checkpoint, kernels, monkeypatch):
    """Steps whose requests all sample greedily take Model.compute_greedy_tokens (the LM head's
    argmax without logits where the platform's method has one) and give the tokens the logits
    give; a step with a logprobs request samples from the logits."""
    from engine_llama.model import LlamaForCausalLM

    greedy = [(p, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)) for p in prompts(5, seed=8)]
    with_logprobs = greedy[:2] + [
        (greedy[2][0], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2))
    ]
    asked = []
    original = LlamaForCausalLM.compute_greedy_tokens

    def spy(self, hidden):
        asked.append(hidden.shape[0])
        return original(self, hidden)

    llm = make_llm(checkpoint, "bfloat16")
    monkeypatch.setattr(LlamaForCausalLM, "compute_greedy_tokens", lambda self, hidden: None)
    expected = [o.outputs[0].token_ids for o in llm.generate(*zip(*greedy), use_tqdm=False)]
    monkeypatch.setattr(LlamaForCausalLM, "compute_greedy_tokens", spy)
    got = [o.outputs[0].token_ids for o in llm.generate(*zip(*greedy), use_tqdm=False)]
    assert got == expected and asked
    asked.clear()
    outputs = llm.generate(*zip(*with_logprobs), use_tqdm=False)
    assert asked == [] and outputs[2].outputs[0].logprobs
    assert [o.outputs[0].token_ids for o in outputs] == expected[:3]


def test_a_forward_that_cannot_be_captured_runs_eagerly_and_says_why(checkpoint, kernels, monkeypatch, caplog):
    from engine_llama.model import LlamaForCausalLM

    forward = LlamaForCausalLM.forward

    def reads_positions(self, input_ids, positions, ctx):
        positions.tolist()
        return forward(self, input_ids, positions, ctx)

    requests = [(p, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)) for p in prompts(3, seed=5)]
    expected = [
        o.outputs[0].token_ids
        for o in make_llm(checkpoint, "bfloat16", enforce_eager=True).generate(*zip(*requests), use_tqdm=False)
    ]
    monkeypatch.setattr(LlamaForCausalLM, "forward", reads_positions)
    with caplog.at_level(logging.INFO, logger="engine"):
        llm = make_llm(checkpoint, "bfloat16")
        got = [o.outputs[0].token_ids for o in llm.generate(*zip(*requests), use_tqdm=False)]
    assert got == expected
    graphs = llm.engine.shard.runner.graphs
    assert graphs.disabled and graphs.graphs == {} and graphs.replays == 0
    assert any("decode steps run eagerly: the forward cannot be captured (Tensor.tolist" in m for m in caplog.messages)


def test_no_graphs_without_the_native_kernels(monkeypatch):
    from engine_cpu.platform import CpuPlatform

    monkeypatch.setenv("ENGINE_CPU_NATIVE", "0")
    assert CpuPlatform().device_graphs() is None
    monkeypatch.delenv("ENGINE_CPU_NATIVE")
    if native.load() is not None:
        assert CpuPlatform().device_graphs() is cpu_graphs.CpuGraph
