"""Tensor parallelism on this CPU (gloo): two ranks give the greedy output of one for each
family that shards (Llama with 2 KV heads and with one replicated KV head, DeepSeek-V3's
MLA and routed experts, Kimi Linear's KDA and MLA), through ``LLM`` and ``engine serve``;
the sharded layers against their whole counterparts in one process; what is refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import torch

from engine.distributed.executor import free_local_address
from engine.distributed.parallel_state import TensorParallel, tensor_parallel
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.selection import SelectionError
from engine.testing.checkpoints import make_tiny_checkpoint

PROMPTS = [[1, 5, 9, 12, 7], [3, 4, 8, 2, 6, 11, 13, 17, 19, 21, 3], list(range(3, 40))]
CASES = {
    # name: (architecture, plugin, config overrides)
    "llama-gqa": ("LlamaForCausalLM", "llama", {"num_key_value_heads": 2}),
    # one KV head on two ranks (replicated), and a vocabulary that does not split evenly
    "llama-mqa": ("LlamaForCausalLM", "llama", {"num_key_value_heads": 1, "vocab_size": 321}),
    "deepseek-v3": ("DeepseekV3ForCausalLM", "deepseek_v4", {}),
    "kimi-linear": ("KimiLinearForCausalLM", "kimi_k3", {}),
}


def greedy(path: Path, plugin: str, tp: int, prompts: list[list[int]] = PROMPTS, n: int = 12) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    with LLM(
        str(path),
        plugins=["cpu", plugin],
        dtype="float32",
        tensor_parallel_size=tp,
        kv_cache_memory=0.05,
        progress=False,
    ) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}
    for name, (architecture, plugin, overrides) in CASES.items():
        path = tmp_path_factory.mktemp(name)
        make_tiny_checkpoint(architecture, path, **overrides)
        made[name] = (path, plugin)
    return made


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_give_the_greedy_output_of_one(checkpoints, case):
    path, plugin = checkpoints[case]
    assert greedy(path, plugin, 2) == greedy(path, plugin, 1)


# the sharded layers, one rank at a time in this process (no collectives: the test sums)


def test_column_and_row_parallel_parts_make_the_whole_layer():
    from engine.layers.linear import (
        ColumnParallelLinear,
        MergedLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )

    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 12, generator=g)
    gate, up, down = torch.randn(8, 12, generator=g), torch.randn(8, 12, generator=g), torch.randn(12, 8, generator=g)
    bias = torch.randn(12, generator=g)
    whole_up = MergedLinear(12, [8, 8], False, torch.float32)
    whole_up.load_checkpoint_tensor("weight", 0, gate)
    whole_up.load_checkpoint_tensor("weight", 1, up)
    hidden = torch.nn.functional.silu(whole_up(x)[:, :8]) * whole_up(x)[:, 8:]
    expected = hidden @ down.T + bias
    total = torch.zeros(5, 12)
    for rank in range(2):
        with tensor_parallel(TensorParallel(rank=rank, size=2)):
            column = ColumnParallelLinear(12, [8, 8], False, torch.float32)
            row = RowParallelLinear(8, 12, True, torch.float32)
        column.load_checkpoint_tensor("weight", 0, gate)
        column.load_checkpoint_tensor("weight", 1, up)
        row.load_checkpoint_tensor("weight", 0, down)
        row.load_checkpoint_tensor("bias", 0, bias)
        part = column.method.apply(column, x)  # this rank's 4 gate then 4 up columns
        assert torch.equal(part[:, :4], x @ gate[4 * rank : 4 * rank + 4].T)
        total += row.method.apply(row, torch.nn.functional.silu(part[:, :4]) * part[:, 4:])
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-5)

    # QKV: 4 query heads split, one KV head replicated on both ranks
    weights = [torch.randn(4 * 3, 12, generator=g), torch.randn(3, 12, generator=g), torch.randn(3, 12, generator=g)]
    for rank in range(2):
        with tensor_parallel(TensorParallel(rank=rank, size=2)):
            qkv = QKVParallelLinear(12, 4, 1, 3, False, torch.float32)
        for shard, w in enumerate(weights):
            qkv.load_checkpoint_tensor("weight", shard, w)
        assert torch.equal(qkv.weight, torch.cat([weights[0][6 * rank : 6 * rank + 6], weights[1], weights[2]]))


def test_vocab_parallel_embedding_and_head_cover_an_uneven_vocabulary():
    from engine.layers.linear import ParallelLMHead, VocabEmbedding

    g = torch.Generator().manual_seed(1)
    table = torch.randn(11, 6, generator=g)
    ids = torch.tensor([0, 5, 6, 10, 3])
    embedded, logits = torch.zeros(5, 6), []
    for rank in range(2):
        with tensor_parallel(TensorParallel(rank=rank, size=2)):
            embedding = VocabEmbedding(11, 6, torch.float32)
            head = ParallelLMHead(6, 11, torch.float32)
        embedding.load_checkpoint("embed_tokens.weight", table)
        head.load_checkpoint_tensor("weight", 0, table)
        assert embedding.weight.shape == (6, 6) and head.weight.shape == (6, 6)  # 11 rows: 6 + 5 and a zero row
        local = ids - embedding.start
        mine = (local >= 0) & (local < embedding.length)
        embedded += torch.nn.functional.embedding(local.clamp(0, 5), embedding.weight) * mine.unsqueeze(-1)
        logits.append(head.method.apply(head, embedded[:1]))
    assert torch.equal(embedded, table[ids])
    torch.testing.assert_close(torch.cat(logits, dim=-1)[:, :11], embedded[:1] @ table.T)


def test_a_prequantized_tensor_that_does_not_split_is_refused_by_name():
    from engine.layers.linear import ColumnParallelLinear

    with tensor_parallel(TensorParallel(rank=0, size=2)):
        layer = ColumnParallelLinear(12, [8], False, torch.float32)
    with pytest.raises(ValueError, match=r"'weight.absmax' \(3,\).*cannot be split across 2 tensor-parallel ranks"):
        layer.local_part("weight.absmax", 0, torch.zeros(3))


def test_heads_that_do_not_split_are_refused(tmp_path):
    with pytest.raises(ValueError, match="num_key_value_heads \\(3\\)"):
        TensorParallel(rank=0, size=2).kv_heads(3)
    with pytest.raises(ValueError, match="num_attention_heads \\(3\\) is not divisible by the tensor-parallel size 2"):
        TensorParallel(rank=0, size=2).split(3, "num_attention_heads")


# what is refused before any rank starts, and what the spawned ranks are given


def test_the_spawned_ranks_get_the_plugins_this_process_loaded_by_name(checkpoints, monkeypatch):
    """With plugins autoloaded (None), the workers' configuration names every plugin rank 0
    loaded, so that they load the same set whatever their environment."""
    from engine.engine import ranks

    class Spawned(Exception):
        pass

    def capture(config, world_size, init_method, on_death):
        raise Spawned(config, world_size)

    monkeypatch.setattr(ranks, "LocalWorkers", capture)
    path, _ = checkpoints["llama-gqa"]
    with pytest.raises(Spawned) as caught:
        LLM(str(path), dtype="float32", tensor_parallel_size=2, progress=False)
    config, world_size = caught.value.args
    from engine.plugins.manager import get_plugin_manager

    loaded = [info.name for info in get_plugin_manager(None).plugin_infos if info.loaded]
    assert world_size == 2 and config.plugins == loaded and {"cpu", "llama"} <= set(config.plugins)


def test_a_model_that_does_not_shard_is_refused(tmp_path):
    make_tiny_checkpoint("DeepseekV32ForCausalLM", tmp_path)
    with pytest.raises(SelectionError, match="DeepseekV32ForCausalLM does not support tensor parallelism"):
        LLM(str(tmp_path), plugins=["cpu", "deepseek_v4"], dtype="float32", tensor_parallel_size=2, progress=False)


def test_torchrun_world_size_must_match(checkpoints, monkeypatch):
    path, plugin = checkpoints["llama-gqa"]
    for name, value in {"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="WORLD_SIZE=3 .*--tensor-parallel-size is 2"):
        LLM(str(path), plugins=["cpu", plugin], dtype="float32", tensor_parallel_size=2, progress=False)


def test_a_worker_rank_refuses_what_rank_0_refuses_before_joining(checkpoints, tmp_path):
    """Under torchrun each rank builds its own engine: a worker rank checks the rank count and
    the model's support itself, so that it fails as rank 0 does instead of waiting for it."""
    from engine.config import EngineConfig
    from engine.distributed.executor import Launch
    from engine.runtime.llm_engine import LLMEngine

    path, plugin = checkpoints["llama-gqa"]
    config = EngineConfig(model=str(path), plugins=["cpu", plugin], dtype="float32", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="rank 1 of 3, but --tensor-parallel-size is 2"):
        LLMEngine(config, progress=False, launch=Launch(1, 3, "env://"))
    make_tiny_checkpoint("DeepseekV32ForCausalLM", tmp_path)
    config = EngineConfig(model=str(tmp_path), plugins=["cpu", "deepseek_v4"], dtype="float32", tensor_parallel_size=2)
    with pytest.raises(SelectionError, match="does not support tensor parallelism"):
        LLMEngine(config, progress=False, launch=Launch(1, 2, "env://"))


# engine serve, and a worker killed mid-generation


def engine_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "engine", *args]


def children(pid: int) -> list[int]:
    """Child processes of ``pid`` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def free_port() -> int:
    return int(free_local_address().rsplit(":", 1)[1])


@contextmanager
def tensor_parallel_server(path: Path, plugin: str) -> Iterator[tuple[subprocess.Popen, int]]:
    """``engine serve`` on two ranks, up and answering; killed on the way out if still running."""
    for attempt in range(3):
        port = free_port()
        try:
            server = start_server(path, plugin, port)
            break
        except AssertionError as exc:
            # the port was free when chosen; the ranks' rendezvous may take it before the server binds it
            if "address already in use" not in str(exc) or attempt == 2:
                raise
    try:
        yield server, port
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def start_server(path: Path, plugin: str, port: int) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    server = subprocess.Popen(
        engine_command(
            "serve",
            str(path),
            "--plugins",
            f"cpu,{plugin}",
            "--dtype",
            "float32",
            "--port",
            str(port),
            "--tensor-parallel-size",
            "2",
            "--kv-cache-memory",
            "0.05",
        ),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"the server exited with {server.returncode}:\n{server.stdout.read()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    server.kill()
    raise AssertionError("the server did not come up")


def worker_pids(server: subprocess.Popen) -> list[int]:
    """The spawned rank processes (not multiprocessing's resource tracker)."""
    pids = []
    for pid in children(server.pid):
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        if "engine.engine.workers" in command:
            pids.append(pid)
    return pids


@pytest.mark.parametrize("case", list(CASES))
def test_engine_serve_on_two_ranks_answers_as_one_rank_does(checkpoints, case):
    path, plugin = checkpoints[case]
    with tensor_parallel_server(path, plugin) as (server, port):
        assert len(worker_pids(server)) == 1
        answers = [
            httpx.post(
                f"http://127.0.0.1:{port}/v1/completions",
                timeout=60,
                json={
                    "model": str(path),
                    "prompt": prompt,
                    "max_tokens": 12,
                    "temperature": 0,
                    "ignore_eos": True,
                    "return_token_ids": True,
                },
            ).json()
            for prompt in PROMPTS
        ]
        server.send_signal(signal.SIGINT)
        server.wait(30)
    assert [a["choices"][0]["token_ids"] for a in answers] == greedy(path, plugin, 1)


def test_a_killed_worker_fails_the_requests_in_flight_and_the_server_exits(checkpoints):
    path, plugin = checkpoints["llama-gqa"]
    with tensor_parallel_server(path, plugin) as (server, port):
        (worker,) = worker_pids(server)
        with httpx.stream(
            "POST",
            f"http://127.0.0.1:{port}/v1/completions",
            timeout=60,
            json={
                "model": str(path),
                "prompt": PROMPTS[2],
                "max_tokens": 400,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            },
        ) as response:
            assert response.status_code == 200
            events = []
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
                    if len(events) == 3:
                        os.kill(worker, signal.SIGKILL)
        killed = time.monotonic()
        assert "error" in events[-1], events[-1]
        assert "tensor-parallel worker" in events[-1]["error"]["message"]
        assert server.wait(30) == 1
        assert time.monotonic() - killed < 15


def test_a_worker_killed_while_the_server_idles_stops_the_server(checkpoints):
    path, plugin = checkpoints["llama-gqa"]
    with tensor_parallel_server(path, plugin) as (server, _):
        (worker,) = worker_pids(server)
        os.kill(worker, signal.SIGKILL)
        assert server.wait(15) == 1
    assert "tensor-parallel worker engine-tp-rank-1" in server.stdout.read()


def test_two_torchrun_launches_on_loopback_act_as_two_nodes(checkpoints):
    """``torchrun --nnodes 2`` started twice (node ranks 0 and 1) on 127.0.0.1: rank 0 prints
    the output of one rank, the other serves its steps; both exit 0."""
    path, plugin = checkpoints["llama-gqa"]
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    launches = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--node-rank",
                str(node),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                "-m",
                "engine",
                "generate",
                str(path),
                "--plugins",
                f"cpu,{plugin}",
                "--dtype",
                "float32",
                "--tensor-parallel-size",
                "2",
                "--kv-cache-memory",
                "0.05",
                "--max-tokens",
                "12",
                "--ignore-eos",
                "--json",
                *[arg for prompt in PROMPTS for arg in ("--prompt-ids", ",".join(map(str, prompt)))],
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in (0, 1)
    ]
    results = [launch.communicate(timeout=300) for launch in launches]
    for launch, (_, err) in zip(launches, results):
        assert launch.returncode == 0, err[-3000:]
    assert results[1][0].strip() == ""  # the worker node prints nothing
    assert [o["token_ids"] for o in json.loads(results[0][0])] == greedy(path, plugin, 1)


@pytest.mark.parametrize("case", ["llama-gqa", "deepseek-v3"])
@pytest.mark.parametrize("store_tp, load_tp", [(2, 1), (1, 2)])
def test_kv_tier_blocks_stored_under_one_rank_count_restore_under_the_other(
    checkpoints, tmp_path, store_tp, load_tp, case
):
    """The disk tier keeps blocks in the canonical layout (every KV head): what two ranks stored
    (each its head of the GQA layers; DeepSeek-V3's latent entries, which every rank holds
    whole) one rank loads, and the other way round, with the outputs of an engine without a
    tier."""
    path, plugin = checkpoints[case]
    prompts = [list(range(3, 3 + 40)), list(range(50, 50 + 33))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def run(tp: int) -> tuple[list[list[int]], int]:
        llm = LLM(
            str(path),
            plugins=["cpu", plugin, "kv_tier_disk"],
            dtype="float32",
            tensor_parallel_size=tp,
            kv_cache_memory=0.01,
            block_size=4,
            progress=False,
            kv_tier="disk",
            kv_tier_config={"path": str(tmp_path), "capacity_gb": 0.1},
        )
        with llm:
            outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            return outputs, llm.engine.kv_tier.stats.prefetched_blocks

    expected = greedy(path, plugin, 1, prompts)
    stored, _ = run(store_tp)
    loaded, prefetched = run(load_tp)
    assert stored == expected and loaded == expected
    # every whole block before each prompt's last token (which is always computed) came from the tier
    assert prefetched == sum((len(p) - 1) // 4 for p in prompts)


def test_checkpoint_tensors_are_views_of_the_mapped_file(tmp_path):
    """What the loader yields equals what safetensors reads, for every dtype, without a
    private copy per tensor (a view of the copy-on-write mapping, so a rank copying its
    part reads only that part); writing to one leaves the file as it was."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from engine.model_loader.weights import mapped_tensors

    g = torch.Generator().manual_seed(3)
    tensors = {
        "f32": torch.randn(3, 5, generator=g),
        "bf16": torch.randn(7, generator=g).bfloat16(),
        "f16": torch.randn(2, 2, generator=g).half(),
        "i64": torch.arange(10).view(2, 5),
        "u8": torch.arange(5, dtype=torch.uint8),
        "f8": torch.randn(4, 4, generator=g).to(torch.float8_e4m3fn),
        "bool": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
    }
    save_file(tensors, tmp_path / "w.safetensors")
    got = dict(mapped_tensors(tmp_path / "w.safetensors"))
    assert set(got) == set(tensors)
    for name, tensor in tensors.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    # one mapping: the tensors lie as far apart in memory as in the file (no copy per tensor)
    raw = (tmp_path / "w.safetensors").read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    for name in ("bf16", "i64", "u8"):
        assert (
            got[name].data_ptr() - got["f32"].data_ptr()
            == header[name]["data_offsets"][0] - header["f32"]["data_offsets"][0]
        )
    big = got["f32"]
    big.add_(1)
    with safe_open(str(tmp_path / "w.safetensors"), "pt") as handle:
        assert torch.equal(handle.get_tensor("f32"), tensors["f32"])


def test_a_quantizer_applies_to_each_rank_s_part(tmp_path):
    """bitsandbytes NF4 quantizing while loading, on two ranks: every rank quantizes its part
    of each layer (row-parallel parts in their own blocks), so the logits differ from the
    unquantized ones by about what quantizing the whole layers costs, not by garbage. (Each
    rank's input width is kept at 64 or more, bitsandbytes' block size: narrower rows
    quantize worse whatever the rank count.)"""
    path, plugin = tmp_path, "llama"
    make_tiny_checkpoint("LlamaForCausalLM", path, head_dim=32, intermediate_size=256, num_key_value_heads=2)

    def logits(tp: int, quantization: str | None) -> torch.Tensor:
        with LLM(
            str(path),
            plugins=["cpu", plugin, "bitsandbytes"],
            dtype="float32",
            tensor_parallel_size=tp,
            kv_cache_memory=0.05,
            progress=False,
            quantization=quantization,
        ) as llm:
            if quantization:
                methods = {
                    type(m.method).__name__
                    for n, m in llm.engine.model.named_modules()
                    if hasattr(m, "method") and n != "lm_head"
                }
                assert methods == {"BnB4bitLinearMethod"}
            return torch.cat(llm.prompt_logits(PROMPTS))

    reference = logits(1, None)
    one_rank = (logits(1, "bitsandbytes") - reference).abs().mean()
    two_ranks = (logits(2, "bitsandbytes") - reference).abs().mean()
    assert 0 < two_ranks < 1.5 * one_rank, (one_rank, two_ranks)


def test_a_worker_that_dies_before_joining_is_an_error_at_once(checkpoints, tmp_path, monkeypatch):
    """A plugin that cannot load in the spawned rank (here it exits there on import) makes
    building the engine raise WorkerDiedError with the rank's exit status, promptly."""
    from engine.distributed.executor import WorkerDiedError

    module = f"dies_in_workers_{os.getpid()}"
    (tmp_path / f"{module}.py").write_text("import os\nif os.environ.get('ENGINE_WORKER_RANK'):\n    os._exit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path, plugin = checkpoints["llama-gqa"]
    started = time.monotonic()
    with pytest.raises(WorkerDiedError, match="engine-tp-rank-1 .* exited with status 3 before joining"):
        LLM(str(path), plugins=["cpu", plugin, module], dtype="float32", tensor_parallel_size=2, progress=False)
    assert time.monotonic() - started < 60


def test_only_errors_out_of_collectives_count_as_a_lost_rank():
    """A step's own RuntimeError (a model bug, out of memory) passes through unchanged; one
    raised inside torch.distributed is read as a rank that went away."""
    import torch.distributed as dist

    from engine.distributed.executor import raised_by_collective

    with pytest.raises(RuntimeError) as own:
        raise RuntimeError("CUDA out of memory")
    with pytest.raises((RuntimeError, ValueError)) as collective:
        dist.broadcast(torch.zeros(1), src=0)  # no process group: raised in torch.distributed
    assert not raised_by_collective(own.value)
    assert raised_by_collective(collective.value)
