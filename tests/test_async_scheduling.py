"""Async scheduling (the next step's forward on its own thread, started before the engine
hands back this step's result) gives exactly the outputs of the plain loop: greedy and
seeded sampling, with preemption, prefix-cache hits, speculation, logprobs, stop strings,
and requests added and aborted between steps."""

from __future__ import annotations

import random
import threading

import pytest

from engine import LLM, SamplingParams
from engine.engine.llm_engine import LLMEngine
from engine.testing.checkpoints import make_tiny_checkpoint

# 24 blocks of 16 tokens (2 layers x K,V x 2 KV heads x 16 dims x 4 bytes a token): the mixed
# prompts below do not fit at once, so the scheduler preempts
SMALL_CACHE = {"kv_cache_memory": 24 * 16 * (2 * 2 * 2 * 16 * 4) / 2**30, "max_model_len": 256}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_tiny_checkpoint("LlamaForCausalLM", path, with_tokenizer=True)
    return path


def make_llm(path, **options) -> LLM:
    return LLM(str(path), plugins=["cpu", "llama"], dtype="float32", progress=False, **options)


def mixed_prompts() -> list[list[int]]:
    """Prompts sharing prefixes (prefix hits) and repeating themselves (ngram drafts)."""
    rng = random.Random(0)
    shared = [rng.randrange(1, 200) for _ in range(40)]
    prompts = []
    for i in range(10):
        tail = [rng.randrange(1, 200) for _ in range(rng.randint(3, 30))]
        prompts.append((shared if i % 2 else []) + tail + tail[:8])
    return prompts


def mixed_params(n: int, sampled: bool = True) -> list[SamplingParams]:
    """Greedy and (``sampled``) seeded sampling, some with logprobs or stop strings."""
    params = []
    for i in range(n):
        if not sampled:
            params.append(
                SamplingParams(temperature=0.0, max_tokens=40 + i, ignore_eos=True, stop=["e"] if i % 4 == 1 else [])
            )
        elif i % 3 == 0:
            params.append(SamplingParams(temperature=0.0, max_tokens=24 + i, ignore_eos=True))
        elif i % 3 == 1:
            params.append(SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=20, logprobs=2))
        else:
            params.append(SamplingParams(temperature=1.0, top_k=20, seed=7 * i, max_tokens=30, stop=["e"]))
    return params


def outputs_of(llm: LLM, prompts, params) -> list[tuple]:
    result = []
    for o in llm.generate(prompts, params, use_tqdm=False):
        out = o.outputs[0]
        logprobs = None if out.logprobs is None else [sorted(step.items()) for step in out.logprobs]
        result.append((out.token_ids, out.text, out.finish_reason, logprobs))
    return result


@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_outputs_are_identical_with_async_scheduling_on_and_off(checkpoint, speculative):
    """With speculation only greedy requests are compared: how many drafts a sampled request
    gets depends on measured step times, and with them the random numbers it draws."""
    prompts = mixed_prompts()
    params = mixed_params(len(prompts), sampled=speculative is None)
    options = dict(SMALL_CACHE, speculative_method=speculative) if speculative else dict(SMALL_CACHE)
    plain = make_llm(checkpoint, **options)
    expected = outputs_of(plain, prompts, params)
    overlapped = make_llm(checkpoint, async_scheduling=True, **options)
    assert overlapped.engine.shard.executor is not None
    assert outputs_of(overlapped, prompts, params) == expected
    # the runs really preempted, hit the prefix cache and drafted
    engine = overlapped.engine
    assert engine.scheduler.num_preemptions > 0 and engine.kv_manager.stats.hits > 0
    if speculative:
        assert engine.spec.stats.proposed > 0
    else:  # steps were scheduled while the step before ran, with the tokens it sampled filled in later
        assert engine.scheduler.num_scheduled_ahead > 10
    assert engine.kv_manager.num_free_blocks == engine.kv_cache.num_blocks
    overlapped.close()


def drive(engine: LLMEngine, prompts, params) -> dict[str, list[int]]:
    """Add requests and abort one between steps, as a server does; the tokens each kept."""
    finished: dict[str, list[int]] = {}
    pending = list(enumerate(zip(prompts, params)))
    steps = 0
    while pending or engine.has_unfinished():
        if pending and steps % 2 == 0:  # a new request every other step
            i, (prompt, p) = pending.pop(0)
            engine.add_request(f"r{i}", prompt, p)
        if steps == 5:
            engine.abort("r1")
        result = engine.step()
        steps += 1
        for request in result.finished:
            finished[request.request_id] = list(request.output_token_ids)
    return finished


def test_requests_added_and_aborted_between_steps_run_as_without_async(checkpoint):
    prompts = mixed_prompts()[:6]
    params = mixed_params(len(prompts))
    expected = drive(make_llm(checkpoint, **SMALL_CACHE).engine, prompts, params)
    engine = make_llm(checkpoint, async_scheduling=True, **SMALL_CACHE).engine
    assert drive(engine, prompts, params) == expected
    assert engine.scheduler.num_scheduled_ahead > 0
    assert "r1" not in expected or len(expected["r1"]) < params[1].max_tokens
    assert engine.kv_manager.num_free_blocks == engine.kv_cache.num_blocks and not engine.requests
    engine.close()


def test_the_next_forward_runs_on_its_own_thread_while_the_caller_reads(checkpoint):
    engine = make_llm(checkpoint, async_scheduling=True).engine
    threads = set()
    forward = engine.model.forward

    def recording(*args, **kwargs):
        threads.add(threading.current_thread().name)
        return forward(*args, **kwargs)

    engine.model.forward = recording
    engine.add_request("a", [1, 2, 3, 4], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    engine.step()
    assert engine._in_flight is not None  # step 2 was started before step 1's result came back
    while engine.has_unfinished():
        engine.step()
    assert threads and all(name.startswith("engine-forward") for name in threads)
    engine.close()


def test_requests_whose_sampling_reads_their_output_are_scheduled_after_the_step(checkpoint):
    """Penalties and a pending min_tokens read the previous token: with such a request running
    the next step waits for it, and the outputs still match."""
    prompts = mixed_prompts()[:4]
    params = [
        SamplingParams(temperature=0.8, seed=3, max_tokens=16, repetition_penalty=1.3, presence_penalty=0.5),
        SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12),
        SamplingParams(temperature=0.0, max_tokens=30, min_tokens=30),
        SamplingParams(temperature=1.0, seed=9, max_tokens=30, frequency_penalty=0.7),
    ]
    expected = outputs_of(make_llm(checkpoint), prompts, params)
    overlapped = make_llm(checkpoint, async_scheduling=True)
    assert outputs_of(overlapped, prompts, params) == expected
    assert overlapped.engine.scheduler.num_scheduled_ahead == 0
    overlapped.close()


def test_unset_async_scheduling_follows_the_platform(checkpoint, monkeypatch):
    """Without --async-scheduling the platform decides (engine-cuda: on, the CPU: off); the
    option given either way wins, and the outputs do not change."""
    from engine_cpu.platform import CpuPlatform

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = mixed_prompts()[:3]
    plain = make_llm(checkpoint)
    assert plain.engine.async_scheduling is False and plain.engine.shard.executor is None
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    monkeypatch.setattr(CpuPlatform, "async_scheduling_default", True)
    overlapped = make_llm(checkpoint)
    assert overlapped.engine.async_scheduling is True and overlapped.engine.shard.executor is not None
    assert [o.outputs[0].token_ids for o in overlapped.generate(prompts, params, use_tqdm=False)] == expected
    assert make_llm(checkpoint, async_scheduling=False).engine.async_scheduling is False
