"""Sampling features end to end (engine-cpu + engine-llama, fp32) against HF transformers,
hand-built cases and the engine's own unconstrained runs."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from engine.testing.checkpoints import make_tiny_checkpoint

    path = tmp_path_factory.mktemp("llama-tok")
    hf_model = make_tiny_checkpoint("LlamaForCausalLM", path, with_tokenizer=True)
    return path, hf_model


@pytest.fixture(scope="module")
def llm(checkpoint):
    return make_llm(checkpoint[0])


def make_llm(path, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory", 0.05)
    return LLM(str(path), plugins=["cpu", "llama"], dtype="float32", progress=False, **kwargs)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 320) for _ in range(rng.randint(4, 20))] for _ in range(n)]


def hf_logprobs(hf_model, token_ids: list[int]) -> torch.Tensor:
    """[len, V]: row i is log p(. | token_ids[:i+1]) under HF transformers."""
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float().log_softmax(-1)


# logprobs


def check_entry(entry: dict, token: int, reference: torch.Tensor, num_top: int, tokenizer) -> None:
    """entry: {id: Logprob} from the engine; reference: HF log-probs [V] for this position."""
    assert abs(entry[token].logprob - float(reference[token])) < 1e-4
    assert entry[token].rank == 1 + int((reference > reference[token]).sum())
    top = reference.topk(num_top).indices.tolist()
    assert set(entry) == set(top) | {token}
    for rank, t in enumerate(top, start=1):
        assert abs(entry[t].logprob - float(reference[t])) < 1e-4 and entry[t].rank == rank
    assert all(lp.decoded_token == tokenizer.decode([t]) for t, lp in entry.items())


def test_logprobs_and_prompt_logprobs_match_hf(checkpoint, llm):
    _, hf_model = checkpoint
    tokenizer = llm.get_tokenizer()
    ps = prompts(3, seed=10)
    params = [
        SamplingParams(temperature=0.8, seed=3, max_tokens=10, ignore_eos=True, logprobs=5, prompt_logprobs=4),
        SamplingParams(
            temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0, prompt_logprobs=0, repetition_penalty=1.5
        ),
        SamplingParams(temperature=0.8, top_k=20, seed=5, max_tokens=8, ignore_eos=True),  # no logprobs asked
    ]
    outputs = llm.generate(ps, params, use_tqdm=False)
    ranks = []
    for prompt, p, output in zip(ps, params, outputs):
        completion = output.outputs[0]
        if p.logprobs is None:
            assert completion.logprobs is None and completion.cumulative_logprob is None
            assert output.prompt_logprobs is None
            continue
        reference = hf_logprobs(hf_model, prompt + completion.token_ids)
        assert len(completion.logprobs) == len(completion.token_ids)
        for j, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            # the raw distribution: not the tempered or penalised one the token was drawn from
            check_entry(entry, token, reference[len(prompt) - 1 + j], p.logprobs, tokenizer)
            ranks.append(entry[token].rank)
        expected_sum = sum(float(reference[len(prompt) - 1 + j, t]) for j, t in enumerate(completion.token_ids))
        assert abs(completion.cumulative_logprob - expected_sum) < 1e-3
        assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(prompt)
        for i in range(1, len(prompt)):
            check_entry(output.prompt_logprobs[i], prompt[i], reference[i - 1], p.prompt_logprobs, tokenizer)
    assert max(ranks) > 1  # sampled tokens are not always the most likely: ranks were really checked


def test_prompt_logprobs_survive_chunked_prefill_and_the_prefix_cache(checkpoint):
    path, hf_model = checkpoint
    llm = make_llm(path, max_num_batched_tokens=7, block_size=4)
    [prompt] = prompts(1, seed=11)
    prompt = prompt + prompt  # long enough for several chunks and cached blocks
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)  # fills the prefix cache
    [output] = llm.generate([prompt], params, use_tqdm=False)
    reference = hf_logprobs(hf_model, prompt)
    assert len(output.prompt_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        check_entry(output.prompt_logprobs[i], prompt[i], reference[i - 1], 2, llm.get_tokenizer())


def test_preemption_changes_no_logprobs_or_text(checkpoint):
    path, _ = checkpoint
    ps = prompts(4, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    reference = make_llm(path).generate(ps, params, use_tqdm=False)
    # 24 blocks of 4 tokens: the four requests cannot all stay; recomputed prompts must not be recorded twice
    bytes_per_block = 4 * 2 * 2 * 2 * 16 * 4  # tokens * layers * (K, V) * kv heads * head dim * fp32
    small = make_llm(
        path, block_size=4, max_model_len=64, max_num_batched_tokens=16, kv_cache_memory=24 * bytes_per_block / 2**30
    )
    outputs = small.generate(ps, params, use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    for a, b in zip(reference, outputs):
        x, y = a.outputs[0], b.outputs[0]
        assert (x.token_ids, x.text) == (y.token_ids, y.text)
        assert [e.keys() for e in x.logprobs] == [e.keys() for e in y.logprobs]
        assert abs(x.cumulative_logprob - y.cumulative_logprob) < 1e-3
        assert len(b.prompt_logprobs) == len(a.prompt_logprobs)
        for e, f in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert e.keys() == f.keys() and all(abs(e[t].logprob - f[t].logprob) < 1e-4 for t in e)


# stop strings


def spanning_stop_string(tokenizer, token_ids: list[int]) -> tuple[str, int, int] | None:
    """(stop, k, index): a 2-character string made of the last character of tokens[:k]'s text and
    the first of token k's, first occurring at ``index`` in the whole text."""
    text = tokenizer.decode(token_ids)
    for k in range(1, len(token_ids)):
        head = tokenizer.decode(token_ids[:k])
        if not head or head.endswith("\ufffd") or not text.startswith(head) or len(text) <= len(head):
            continue
        stop = text[len(head) - 1 : len(head) + 1]
        if stop.isprintable() and "\ufffd" not in stop and text.find(stop) == len(head) - 1:
            return stop, k, len(head) - 1
    return None


@pytest.fixture(scope="module")
def stop_case(llm):
    """(prompt, free greedy completion, stop string spanning tokens k-1 and k, k, its index in the text)."""
    tokenizer = llm.get_tokenizer()
    candidates = ["The quick brown fox", "Plugins register", "Hello world", "KV cache", "An engine"]
    frees = llm.generate(candidates, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    for prompt, free in zip(candidates, frees):
        case = spanning_stop_string(tokenizer, free.outputs[0].token_ids)
        if case is not None:
            return prompt, free.outputs[0], *case
    pytest.fail("no generated text had a stop string spanning two tokens")


def test_stop_string_spanning_two_tokens_is_honoured_and_excluded(llm, stop_case):
    prompt, free, stop, k, index = stop_case
    tokenizer = llm.get_tokenizer()
    assert stop not in tokenizer.decode(free.token_ids[:k])  # the string really needs token k too
    base = dict(temperature=0.0, max_tokens=16, ignore_eos=True)
    out, kept, late = (
        o.outputs[0]
        for o in llm.generate(
            [prompt] * 3,
            [
                SamplingParams(**base, stop=[stop, "\x00never"]),
                SamplingParams(**base, stop=stop, include_stop_str_in_output=True),
                # before min_tokens outputs exist the stop string is not honoured
                SamplingParams(**base, stop=stop, min_tokens=k + 1),
            ],
            use_tqdm=False,
        )
    )
    assert out.text == free.text[:index]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == free.token_ids[: k + 1]  # generation ended with the token that completed it
    assert kept.text == free.text[: index + len(stop)]
    assert kept.finish_reason == "stop" and kept.stop_reason == stop
    assert len(late.token_ids) > k + 1 and late.text.startswith(free.text[: index + len(stop)])


def test_streamed_deltas_add_up_and_never_show_the_stop_string(llm, stop_case):
    prompt, free, stop, k, index = stop_case
    engine = llm.engine
    tokenizer = llm.get_tokenizer()
    request = engine.add_request(
        "stream-1",
        tokenizer.encode(prompt),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop]),
    )
    deltas = []
    while not request.status.finished:
        engine.step()
        deltas.append(request.take_output_text_delta())
        assert stop not in "".join(deltas)
    assert "".join(deltas) == request.output_text == free.text[:index]


def test_stop_token_text_is_left_out_unless_asked(llm, stop_case):
    prompt, free = stop_case[:2]
    stop_token = free.token_ids[4]
    first = free.token_ids.index(stop_token)
    tokenizer = llm.get_tokenizer()
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_token], include_stop_str_in_output=include)
        for include in (False, True)
    ]
    for include, out in zip((False, True), llm.generate([prompt] * 2, params, use_tqdm=False)):
        completion = out.outputs[0]
        assert completion.token_ids == free.token_ids[: first + 1] and completion.stop_reason == stop_token
        assert completion.text == tokenizer.decode(completion.token_ids[: None if include else -1])


# min_tokens


def test_min_tokens_defers_eos(checkpoint, llm, tmp_path):
    from engine.testing.checkpoints import make_tiny_checkpoint

    _, hf_model = checkpoint
    [p] = prompts(1, seed=4)
    free = (
        llm.generate([p], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )
    eos = free[3]
    first_eos = free.index(eos)
    eos_path = tmp_path / "with-eos"
    make_tiny_checkpoint("LlamaForCausalLM", eos_path, eos_token_id=eos)  # same weights, this eos
    eos_llm = make_llm(eos_path)
    min_tokens = first_eos + 3
    stopped, deferred = (
        o.outputs[0]
        for o in eos_llm.generate(
            [p, p],
            [
                SamplingParams(temperature=0.0, max_tokens=12),
                SamplingParams(temperature=0.0, max_tokens=12, min_tokens=min_tokens),
            ],
            use_tqdm=False,
        )
    )
    assert stopped.token_ids == free[: first_eos + 1] and stopped.finish_reason == "stop"
    assert eos not in deferred.token_ids[:min_tokens]
    assert deferred.token_ids[:first_eos] == free[:first_eos]
    # where EOS was the argmax, the runner-up (HF's logits without EOS) is chosen instead
    reference = hf_logprobs(hf_model, p + deferred.token_ids)
    for j in range(min_tokens):
        row = reference[len(p) - 1 + j].clone()
        row[eos] = float("-inf")
        assert deferred.token_ids[j] == int(row.argmax())
    if eos in deferred.token_ids:
        assert deferred.token_ids.index(eos) == len(deferred.token_ids) - 1 and deferred.finish_reason == "stop"
    else:
        assert len(deferred.token_ids) == 12 and deferred.finish_reason == "length"


# n > 1


def test_n_samples_are_reproducible_and_are_the_seeded_children(llm):
    [p] = prompts(1, seed=12)
    params = SamplingParams(n=2, temperature=1.0, seed=21, max_tokens=12, ignore_eos=True)
    [first] = llm.generate([p], params, use_tqdm=False)
    assert [c.index for c in first.outputs] == [0, 1]
    assert first.outputs[0].token_ids != first.outputs[1].token_ids
    # again, beside another prompt: the same two samples; and sample i is the single request with seed + i
    singles = [SamplingParams(temperature=1.0, seed=21 + i, max_tokens=12, ignore_eos=True) for i in range(2)]
    _, again, *alone = llm.generate(
        [prompts(1, seed=13)[0], p, p, p], [SamplingParams(temperature=1.0), params, *singles], use_tqdm=False
    )
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in first.outputs]
    assert [o.outputs[0].token_ids for o in alone] == [c.token_ids for c in first.outputs]
    assert first.request_id.startswith("offline-") and first.prompt_token_ids == p


def test_n_greedy_gives_identical_completions(llm):
    [p] = prompts(1, seed=14)
    [one] = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    [three] = llm.generate(
        [p], SamplingParams(n=3, temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1), use_tqdm=False
    )
    assert len(three.outputs) == 3
    assert all(c.token_ids == one.outputs[0].token_ids and c.text == one.outputs[0].text for c in three.outputs)
    # the same tokens; their logprobs agree up to the order of the sums, which a batch's row
    # count may change (the three rows may be computed in different batches)
    logprobs = [c.cumulative_logprob for c in three.outputs]
    assert logprobs == pytest.approx([logprobs[0]] * 3, rel=1e-5)


def test_aborting_an_n_request_aborts_every_sample(llm):
    engine = llm.engine
    samples = engine.add_request_group(
        "group-1", prompts(1, seed=15)[0], SamplingParams(n=3, temperature=1.0, max_tokens=50, ignore_eos=True)
    )
    assert [r.request_id for r in samples] == ["0_group-1", "1_group-1", "2_group-1"]
    assert [r.sampling_params.seed for r in samples] == [None, None, None]
    engine.step()
    engine.abort("group-1")
    assert all(r.status.value == "abort" for r in samples)
    assert not engine.has_unfinished() and not engine.request_groups
    with pytest.raises(ValueError, match="add_request_group"):
        engine.add_request("x", [5, 6], SamplingParams(n=2))


# penalties and seeds, end to end


def test_repetition_penalty_matches_hf_greedy(checkpoint, llm):
    _, hf_model = checkpoint
    ps = prompts(3, seed=16)
    outputs = llm.generate(ps, SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.8), use_tqdm=False)
    for p, output in zip(ps, outputs):
        out = output.outputs[0]
        with torch.no_grad():
            hf = hf_model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, repetition_penalty=1.8)
        assert out.token_ids == hf[0, len(p) :].tolist()


def test_seeded_sampling_with_penalties_and_min_p_does_not_depend_on_the_batch(llm):
    ps = prompts(4, seed=17)
    seeded = SamplingParams(
        temperature=0.9,
        seed=99,
        min_p=0.02,
        top_p=0.95,
        repetition_penalty=1.2,
        presence_penalty=0.4,
        frequency_penalty=0.3,
        max_tokens=14,
        ignore_eos=True,
    )
    other = SamplingParams(temperature=1.0, presence_penalty=1.0, max_tokens=10, ignore_eos=True)
    alone = llm.generate([ps[0]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    assert len(alone) == 14
    assert llm.generate([ps[1], ps[2], ps[0]], [other, other, seeded], use_tqdm=False)[2].outputs[0].token_ids == alone
    assert llm.generate([ps[0], ps[3]], [seeded, other], use_tqdm=False)[0].outputs[0].token_ids == alone


# validation


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(n=0), "n must be at least 1"),
        (dict(n=1.5), "n must be an integer"),
        (dict(min_p=1.5), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3), "frequency_penalty"),
        (dict(frequency_penalty="1"), "frequency_penalty must be a finite number"),
        (dict(logprobs=-1), "logprobs"),
        (dict(prompt_logprobs=True), "prompt_logprobs must be an integer"),
        (dict(stop=[""]), "empty string"),
        (dict(stop=3), "stop must be a string or a list"),
        (dict(stop=["a", 3]), "stop must be a string or a list"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=20, max_tokens=10), "must not exceed max_tokens"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(include_stop_str_in_output=1), "include_stop_str_in_output"),
        (dict(seed=1.0), "seed must be an integer"),
        (dict(stop_token_ids=[1, -2]), "stop_token_ids"),
    ],
)
def test_bad_sampling_params_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_engine_rejects_params_it_cannot_serve(checkpoint, llm, tmp_path):
    from engine.testing.checkpoints import make_tiny_checkpoint

    assert SamplingParams(stop="x").stop == ["x"]
    with pytest.raises(ValueError, match="exceeds the vocabulary size 320"):
        llm.generate([[5, 6]], SamplingParams(logprobs=321), use_tqdm=False)
    with pytest.raises(ValueError, match=r"stop_token_ids must be in \[0, 320\)"):
        llm.generate([[5, 6]], SamplingParams(stop_token_ids=[400]), use_tqdm=False)
    no_tokenizer = tmp_path / "no-tokenizer"
    make_tiny_checkpoint("LlamaForCausalLM", no_tokenizer)
    with pytest.raises(ValueError, match="need a tokenizer"):
        make_llm(no_tokenizer).generate([[5, 6]], SamplingParams(stop=["x"]), use_tqdm=False)
    assert not llm.engine.has_unfinished()
