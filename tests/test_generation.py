"""End-to-end generation behaviour of the engine with engine-cpu and engine-llama."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from engine.testing.checkpoints import make_tiny_checkpoint

    path = tmp_path_factory.mktemp("llama")
    hf_model = make_tiny_checkpoint("LlamaForCausalLM", path)
    return path, hf_model


def make_llm(path, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory", 0.05)
    return LLM(str(path), plugins=["cpu", "llama"], dtype="float32", progress=False, **kwargs)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 320) for _ in range(rng.randint(4, 30))] for _ in range(n)]


def greedy(max_tokens: int = 20) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def test_outputs_come_back_in_prompt_order_with_lengths(checkpoint):
    path, _ = checkpoint
    llm = make_llm(path)
    ps = prompts(8)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in range(1, 9)]
    outputs = llm.generate(ps, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == ps
    assert [len(o.outputs[0].token_ids) for o in outputs] == list(range(1, 9))
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outputs)


def test_greedy_outputs_do_not_depend_on_batch_composition(checkpoint):
    path, _ = checkpoint
    llm = make_llm(path)
    ps = prompts(6, seed=1)
    together = llm.generate(ps, greedy(), use_tqdm=False)
    alone = [llm.generate([p], greedy(), use_tqdm=False)[0] for p in ps]
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]


def test_preemption_does_not_change_greedy_outputs(checkpoint):
    path, _ = checkpoint
    ps = prompts(6, seed=2)
    reference = make_llm(path).generate(ps, greedy(40), use_tqdm=False)
    # 24 blocks of 4 tokens hold one sequence of up to 70 tokens, not six at once
    bytes_per_block = 4 * 2 * 2 * 2 * 16 * 4  # tokens * layers * (K, V) * kv heads * head dim * fp32
    small = make_llm(path, block_size=4, max_model_len=96, kv_cache_memory=24 * bytes_per_block / 2**30)
    assert small.engine.kv_cache.num_blocks == 24
    outputs = small.generate(ps, greedy(40), use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in reference]
    assert small.engine.kv_manager.num_free_blocks == 24


def test_stop_token_ids_end_the_request(checkpoint):
    path, _ = checkpoint
    llm = make_llm(path)
    [p] = prompts(1, seed=3)
    free = llm.generate([p], greedy(20), use_tqdm=False)[0].outputs[0].token_ids
    stop = free[5]
    first = free.index(stop)
    out = llm.generate(
        [p], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop]), use_tqdm=False
    )[0].outputs[0]
    assert out.token_ids == free[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_eos_stops_unless_ignored(tmp_path):
    from engine.testing.checkpoints import make_tiny_checkpoint

    [p] = prompts(1, seed=4)
    probe_path = tmp_path / "probe"
    make_tiny_checkpoint("LlamaForCausalLM", probe_path)
    free = make_llm(probe_path).generate([p], greedy(12), use_tqdm=False)[0].outputs[0].token_ids
    eos = free[3]
    path = tmp_path / "with-eos"
    make_tiny_checkpoint("LlamaForCausalLM", path, eos_token_id=eos)
    llm = make_llm(path)
    stopped = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == free[: free.index(eos) + 1] and stopped.finish_reason == "stop"
    ignored = llm.generate([p], greedy(12), use_tqdm=False)[0].outputs[0]
    assert ignored.token_ids == free


def test_seeded_sampling_is_reproducible_across_batches(checkpoint):
    path, _ = checkpoint
    llm = make_llm(path)
    ps = prompts(4, seed=5)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    unseeded = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    alone = llm.generate([ps[0]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate(ps, [unseeded, unseeded, seeded, unseeded], use_tqdm=False)
    reordered = llm.generate([ps[1], ps[0]], [unseeded, seeded], use_tqdm=False)
    # the same prompt with the same seed gives the same tokens wherever it sits
    assert llm.generate([ps[0]], seeded, use_tqdm=False)[0].outputs[0].token_ids == alone
    assert reordered[1].outputs[0].token_ids == alone
    with_seed_at_2 = llm.generate([ps[1], ps[2], ps[0]], [unseeded, unseeded, seeded], use_tqdm=False)
    assert with_seed_at_2[2].outputs[0].token_ids == alone
    assert len(mixed[2].outputs[0].token_ids) == 16


def test_cache_smaller_than_max_model_len_is_refused_at_start(checkpoint):
    path, _ = checkpoint
    with pytest.raises(ValueError, match="max_model_len"):
        make_llm(path, block_size=4, max_model_len=512, kv_cache_memory=10 * 2048 / 2**30)


def test_max_model_len_ends_generation(checkpoint):
    path, _ = checkpoint
    llm = make_llm(path, max_model_len=24)
    out = llm.generate([list(range(3, 23))], greedy(100), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


def test_bad_prompts_are_rejected_clearly(checkpoint):
    path, _ = checkpoint
    llm = make_llm(path, max_model_len=64)
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate(["text needs a tokenizer"], use_tqdm=False)
    with pytest.raises(ValueError, match=r"must be in \[0, 320\)"):
        llm.generate([[1, 2, 320]], use_tqdm=False)
    with pytest.raises(ValueError, match="-1"):
        llm.generate([[1, -1]], use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len is 64"):
        llm.generate([list(range(3, 70))], use_tqdm=False)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    # nothing was left behind in the engine
    assert not llm.engine.has_unfinished()
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.kv_cache.num_blocks


def test_unknown_architecture_lists_the_registered_ones(tmp_path):
    import json

    from engine.plugins.registry import ComponentError
    from engine.testing.checkpoints import make_tiny_checkpoint

    make_tiny_checkpoint("LlamaForCausalLM", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["FancyForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ComponentError, match="Unknown model architecture 'FancyForCausalLM'. Available: LlamaForCausalLM"
    ):
        make_llm(tmp_path)


def test_missing_model_plugin_is_reported(checkpoint):
    from engine.plugins.registry import ComponentError

    path, _ = checkpoint
    with pytest.raises(ComponentError, match="Available: none"):
        LLM(str(path), plugins=["cpu"], progress=False)


def test_module_class_attention_backend(checkpoint):
    path, hf_model = checkpoint
    llm = make_llm(path, attention_backend="engine_cpu.attention:CpuPagedAttention")
    assert type(llm.engine.kv_cache.groups[0].backend).__name__ == "CpuPagedAttention"
    p = prompts(1, seed=6)[0]
    with torch.no_grad():
        reference = hf_model(torch.tensor([p])).logits[0]
    assert (llm.prompt_logits([p])[0] - reference).abs().max().item() < 1e-4


def test_prompt_steps_run_the_last_mlp_on_the_sampled_rows_alone(checkpoint):
    """A step of prompt tokens hands the model the rows sampling reads (ForwardContext.output_rows):
    the last decoder layer runs its MLP on those rows alone, while every layer's attention, and
    so every token's keys and values, covers all tokens. The first tokens and the whole greedy
    continuations equal those of the same engine computing every row, and the logits of
    the first tokens those of the HF model. A request asking for prompt logprobs reads every
    row: that step keeps them all."""
    from engine.runtime.model_runner import ModelRunner

    path, hf_model = checkpoint
    # chunked prompts (middle chunks sample nothing), each run computing them afresh
    llm = make_llm(path, max_num_batched_tokens=64, enable_prefix_caching=False)
    ps = prompts(5, seed=7) + [list(range(3, 103))]
    mlp = llm.engine.runner.model.model.layers[-1].mlp
    seen: list[int] = []
    original = mlp.forward

    def counting(x, ctx):
        seen.append(x.shape[0])
        return original(x, ctx)

    mlp.forward = counting  # the last layer's MLP alone
    try:
        pruned = llm.generate(ps, greedy(12), use_tqdm=False)
        prompt_steps = [n for n in seen if n > 0]
        assert prompt_steps and max(prompt_steps) < 64  # no prompt step ran it on all its rows
        seen.clear()
        full_rows = ModelRunner._output_rows
        ModelRunner._output_rows = lambda self, batch, arrays: None
        try:
            full = llm.generate(ps, greedy(12), use_tqdm=False)
        finally:
            ModelRunner._output_rows = full_rows
        assert max(seen) == 64  # every row of a 64-token step
        assert [o.outputs[0].token_ids for o in pruned] == [o.outputs[0].token_ids for o in full]
        seen.clear()
        llm.generate(ps[:1], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1), use_tqdm=False)
        assert seen[0] == len(ps[0])  # prompt logprobs read every row of the prompt step
    finally:
        del mlp.forward
    with torch.no_grad():
        for prompt, output in zip(ps, pruned):
            logits = hf_model(torch.tensor([prompt])).logits[0, -1]
            assert output.outputs[0].token_ids[0] == int(logits.argmax())
