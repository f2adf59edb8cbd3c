"""Structured output through the whole engine, on both backends: every output of a random
model and of the demo model under a constraint is an instance of it, checked by independent
references (the ``jsonschema`` validator, ``re.fullmatch``, membership); constrained greedy
output does not depend on speculation, preemption or the batch; bad constraints are refused
with a message."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import jsonschema
import pytest

import engine
from engine import LLM, SamplingParams
from engine.interfaces.structured_output import ConstraintError
from engine.sampling_params import StructuredOutputsParams
from engine.testing.checkpoints import make_tiny_checkpoint
from engine.testing.kit.structured_output import whitespace_outside_strings

BACKENDS = ["xgrammar", "llguidance"]
DEMO = Path(engine.__file__).parent / "demo_model"
# 24 blocks of 16 tokens for the tiny model: the prompts below do not fit at once, so the scheduler preempts
SMALL_CACHE = {"kv_cache_memory": 24 * 16 * (2 * 2 * 2 * 16 * 4) / 2**30, "max_model_len": 256}

SCHEMAS = [
    {  # nested objects, optional fields, no extra properties
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 10},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 8},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city"],
                "additionalProperties": False,
            },
            "nickname": {"type": "string", "maxLength": 6},
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    {  # arrays with min/max items, enums
        "type": "object",
        "properties": {
            "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
            "sizes": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "maxItems": 2},
        },
        "required": ["colors", "sizes"],
        "additionalProperties": False,
    },
    {  # numbers with bounds, booleans, a pattern
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "score": {"type": "number", "minimum": -1, "maximum": 1},
            "ok": {"type": "boolean"},
            "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{2,3}$"},
        },
        "required": ["age", "score", "ok", "code"],
        "additionalProperties": False,
    },
    {  # an array at the top, of small objects
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"k": {"type": "string", "maxLength": 4}, "v": {"type": ["integer", "null"]}},
            "required": ["k", "v"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 3,
    },
]
REGEXES = [r"[a-z]{3,8}@[a-z]{2,5}\.(com|net)", r"[0-9]{3}-[0-9]{4}", r"(yes|no|maybe)( [0-9]{1,3})?"]
CHOICES = ["red", "green", "blue", 'dark "violet"', "über"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    make_tiny_checkpoint("LlamaForCausalLM", path, with_tokenizer=True, max_position_embeddings=512)
    return path


_llms: dict = {}


def make_llm(path: Path, backend: str, **options) -> LLM:
    return LLM(
        str(path),
        plugins=["cpu", "llama", backend],
        progress=False,
        structured_output_backend=backend,
        **{"kv_cache_memory": 0.05, "dtype": "float32", **options},
    )


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def tiny_llm(tiny, backend):
    llm = make_llm(tiny, backend)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def demo_llm(backend):
    llm = make_llm(DEMO, backend, dtype="bfloat16")
    yield llm
    llm.close()


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 300) for _ in range(rng.randint(2, 24))] for _ in range(n)]


def sampled(constraint: StructuredOutputsParams, i: int, **extra) -> SamplingParams:
    return SamplingParams(
        temperature=1.0, seed=1000 + i, max_tokens=extra.pop("max_tokens", 320), structured_outputs=constraint, **extra
    )


def assert_valid_json(outputs, schemas) -> None:
    for output, schema in zip(outputs, schemas):
        for sample in output.outputs:
            assert sample.finish_reason == "stop", (sample.finish_reason, sample.text)
            jsonschema.validate(json.loads(sample.text), schema)


def test_json_schema_outputs_of_a_random_model_validate(tiny_llm):
    check_json_schema_outputs(tiny_llm, demo=False)


def test_json_schema_outputs_of_the_demo_model_validate(demo_llm):
    check_json_schema_outputs(demo_llm, demo=True)


def check_json_schema_outputs(llm, demo: bool) -> None:
    n = 200
    schemas = [SCHEMAS[i % len(SCHEMAS)] for i in range(n)]
    params = [
        sampled(StructuredOutputsParams(json=schema, disable_any_whitespace=i % 2 == 0), i)
        for i, schema in enumerate(schemas)
    ]
    text_prompts = [f"Give record {i} as JSON:" for i in range(n)] if demo else prompts(n)
    outputs = llm.generate(text_prompts, params, use_tqdm=False)
    # a number's fraction has no length bound: sampling may write digits until max_tokens, and only there
    long_numbers = [
        o for i, o in enumerate(outputs) if o.outputs[0].finish_reason == "length" and i % len(SCHEMAS) == 2
    ]
    assert len(long_numbers) <= n // 20
    complete = [(o, schema) for o, schema in zip(outputs, schemas) if o not in long_numbers]
    assert_valid_json([o for o, _ in complete], [schema for _, schema in complete])
    compact = [o.outputs[0].text for i, o in enumerate(outputs) if i % 2 == 0 and o not in long_numbers]
    assert compact and not any(whitespace_outside_strings(t) for t in compact)


def test_json_object_regex_choice_and_grammar(tiny_llm):
    n = 60
    params, checks = [], []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            params.append(sampled(StructuredOutputsParams(json_object=True), i, max_tokens=400))
            checks.append(lambda text: isinstance(json.loads(text), dict))
        elif kind == 1:
            pattern = REGEXES[i % len(REGEXES)]
            params.append(sampled(StructuredOutputsParams(regex=pattern), i))
            checks.append(lambda text, pattern=pattern: re.fullmatch(pattern, text) is not None)
        elif kind == 2:
            params.append(sampled(StructuredOutputsParams(choice=CHOICES), i))
            checks.append(lambda text: text in CHOICES)
        else:
            grammar = 'root ::= "(" num ("," num)* ")"\nnum ::= [0-9] | [1-9] [0-9]'
            params.append(sampled(StructuredOutputsParams(grammar=grammar), i))
            checks.append(lambda text: re.fullmatch(r"\((?:[0-9]|[1-9][0-9])(?:,(?:[0-9]|[1-9][0-9]))*\)", text))
    outputs = tiny_llm.generate(prompts(n, seed=1), params, use_tqdm=False)
    for i, (output, check) in enumerate(zip(outputs, checks)):
        sample = output.outputs[0]
        if i % 4 == 0 and sample.finish_reason == "length":  # any JSON object may outgrow max_tokens
            assert sample.text.startswith("{")
            continue
        assert sample.finish_reason == "stop" and check(sample.text), sample.text
    assert sum(o.outputs[0].finish_reason == "stop" for o in outputs[::4]) >= 5  # complete objects too


def test_n_samples_each_follow_the_constraint(tiny_llm):
    params = SamplingParams(
        n=4, temperature=1.0, seed=5, max_tokens=200, structured_outputs=StructuredOutputsParams(json=SCHEMAS[1])
    )
    (output,) = tiny_llm.generate([prompts(1)[0]], params, use_tqdm=False)
    assert len(output.outputs) == 4
    assert_valid_json([output], [SCHEMAS[1]])
    assert len({s.text for s in output.outputs}) > 1  # independent samples


def test_logprobs_are_of_the_masked_distribution(tiny_llm):
    params = SamplingParams(
        temperature=0.0, max_tokens=20, logprobs=3, structured_outputs=StructuredOutputsParams(choice=["alpha", "beta"])
    )
    (output,) = tiny_llm.generate([prompts(1)[0]], params, use_tqdm=False)
    sample = output.outputs[0]
    assert sample.text in ("alpha", "beta") and sample.finish_reason == "stop"
    for token, entry in zip(sample.token_ids, sample.logprobs):
        assert entry[token].logprob > float("-inf")


def test_ignore_eos_still_ends_with_the_constraint(tiny_llm):
    params = SamplingParams(
        temperature=0.0,
        max_tokens=50,
        ignore_eos=True,
        structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
    )
    (output,) = tiny_llm.generate([prompts(1)[0]], params, use_tqdm=False)
    assert output.outputs[0].text in ("yes", "no") and output.outputs[0].finish_reason == "stop"


def test_running_out_of_tokens_is_length(tiny_llm):
    params = SamplingParams(temperature=0.0, max_tokens=3, structured_outputs=StructuredOutputsParams(json=SCHEMAS[0]))
    (output,) = tiny_llm.generate([prompts(1)[0]], params, use_tqdm=False)
    sample = output.outputs[0]
    assert sample.finish_reason == "length" and len(sample.token_ids) == 3 and sample.text.startswith("{")


def greedy_params(n: int) -> list[SamplingParams]:
    kinds = [
        StructuredOutputsParams(json=SCHEMAS[0], disable_any_whitespace=True),
        StructuredOutputsParams(regex=REGEXES[0]),
        StructuredOutputsParams(json=SCHEMAS[2], disable_any_whitespace=True),
        None,
        StructuredOutputsParams(choice=CHOICES),
        StructuredOutputsParams(json=SCHEMAS[3]),
    ]
    return [SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=kinds[i % len(kinds)]) for i in range(n)]


def repetitive_prompts(n: int) -> list[list[int]]:
    # prompts that repeat themselves, so that the ngram proposer drafts
    rng = random.Random(3)
    out = []
    for _ in range(n):
        tail = [rng.randrange(5, 300) for _ in range(rng.randint(4, 20))]
        out.append(tail + tail + tail[:6])
    return out


def texts(outputs) -> list[tuple[str, tuple[int, ...], str]]:
    return [(o.outputs[0].text, tuple(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outputs]


def test_greedy_output_is_the_same_with_speculation_preemption_and_any_batch(tiny, backend):
    n = 12
    ps, params = repetitive_prompts(n), greedy_params(n)
    with make_llm(tiny, backend) as llm:
        reference = texts(llm.generate(ps, params, use_tqdm=False))
        one_by_one = [texts(llm.generate([p], [q], use_tqdm=False))[0] for p, q in zip(ps, params)]
        reversed_batch = texts(llm.generate(ps[::-1], params[::-1], use_tqdm=False))[::-1]
    assert one_by_one == reference and reversed_batch == reference
    for schema_index, i in ((0, 0), (2, 2)):
        text, _, reason = reference[i]
        if reason == "stop":
            jsonschema.validate(json.loads(text), SCHEMAS[schema_index])
    with make_llm(tiny, backend, speculative_method="ngram", num_speculative_tokens=3) as llm:
        speculative = texts(llm.generate(ps, params, use_tqdm=False))
        stats = llm.engine.spec.stats
    assert speculative == reference
    assert stats.proposed > 0 and stats.accepted > 0  # drafts were checked against the masks and some kept
    with make_llm(tiny, backend, **SMALL_CACHE) as llm:
        preempted = texts(llm.generate(ps, params, use_tqdm=False))
        assert llm.engine.scheduler.num_preemptions > 0
    assert preempted == reference
    with make_llm(tiny, backend, enable_prefix_caching=True, max_num_batched_tokens=16) as llm:
        llm.generate(ps[:3], params[:3], use_tqdm=False)  # fills the prefix cache
        chunked = texts(llm.generate(ps, params, use_tqdm=False))  # chunked prefill after cached prefixes
        assert llm.engine.kv_manager.stats.hits > 0
    assert chunked == reference


@pytest.mark.parametrize(
    "constraint",
    [
        StructuredOutputsParams(json={"type": "nonsense"}),
        StructuredOutputsParams(json={"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}),
        StructuredOutputsParams(regex="([a-z]"),
        StructuredOutputsParams(json={"type": "array", "contains": {"type": "integer"}}),
        StructuredOutputsParams(grammar='root ::= ("a"'),
        StructuredOutputsParams(grammar="root ::= " + " | ".join(f'"w{i}"' for i in range(60000))),
    ],
    ids=[
        "invalid-schema",
        "dangling-ref",
        "invalid-regex",
        "unsupported-keyword",
        "invalid-grammar",
        "oversized-grammar",
    ],
)
def test_bad_constraints_are_refused_and_the_engine_goes_on(tiny_llm, constraint):
    with pytest.raises(ConstraintError) as info:
        tiny_llm.generate([prompts(1)[0]], SamplingParams(max_tokens=5, structured_outputs=constraint), use_tqdm=False)
    assert str(info.value)
    assert not tiny_llm.engine.has_unfinished()
    (ok,) = tiny_llm.generate(
        [prompts(1)[0]],
        SamplingParams(max_tokens=5, temperature=0.0, structured_outputs=StructuredOutputsParams(choice=["fine"])),
        use_tqdm=False,
    )
    assert ok.outputs[0].text == "fine"


def test_structured_outputs_params_refuse_what_is_not_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{nope")
    with pytest.raises(ValueError, match="list of strings"):
        StructuredOutputsParams(choice="abc")
    a = StructuredOutputsParams(json={"b": 1, "a": 2})
    b = StructuredOutputsParams(json='{"a": 2, "b": 1}')
    assert a.key == b.key and a.kind == "json"
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs.regex == "a+"


def test_apply_bitmask_matches_a_plain_loop():
    import torch

    from engine.runtime.structured_output import apply_bitmask

    rng = random.Random(0)
    vocab = 77
    logits = torch.randn(5, vocab)
    allowed = [[rng.random() < 0.3 for _ in range(vocab)] for _ in range(3)]
    words = []
    for row in allowed:
        packed = []
        for w in range(3):
            value = sum(1 << b for b in range(32) if w * 32 + b < vocab and row[w * 32 + b])
            packed.append(value - (1 << 32) if value >= 1 << 31 else value)
        words.append(packed)
    bitmask = torch.tensor(words, dtype=torch.int32)
    expected = logits.clone()
    targets = [4, 0, 2]
    for j, row in enumerate(targets):
        for t in range(vocab):
            if not allowed[j][t]:
                expected[row, t] = float("-inf")
    apply_bitmask(logits, bitmask, targets)
    assert torch.equal(logits, expected)
