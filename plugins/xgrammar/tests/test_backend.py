"""The xgrammar backend's bookkeeping and boundaries: discovery, mask hygiene (ids past the
tokenizer, special tokens, EOS), validate / rollback / reset, the batched fill, errors for
invalid and unenforced constraints, settings, concurrent compiles, and the rewrites it
makes of xgrammar's grammars."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
import xgrammar as xgr
from xgrammar_helpers import (
    allowed_tokens,
    backend_class,
    build_backend,
    byte_tokens,
    compile_,
    encode,
    mask_ids,
    new_bitmask,
)

from engine.interfaces.structured_output import ConstraintError, StructuredOutputBackend
from engine.sampling_params import StructuredOutputsParams as P
from engine_xgrammar import grammars

OBJECT = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}, "tag": {"enum": ["a", "b"]}},
    "required": ["id", "tag"],
    "additionalProperties": False,
}
OBJECT_TEXT = '{"id": 42, "tag": "b"}'


def test_discovered_through_its_entry_point():
    cls = backend_class()
    assert issubclass(cls, StructuredOutputBackend) and cls.name == "xgrammar"
    assert cls.supported_kinds == frozenset({"json", "json_object", "regex", "choice", "grammar", "structural_tag"})


# masks


@pytest.mark.parametrize(
    "spec",
    [
        {"grammar": 'root ::= "<" [a-z/]+ ">" | "<" [a-z]+'},
        {"regex": "<[a-z/]*>?"},
        {"choice": ["<s>", "</s>", "<unk>", "x"]},
        {"json": {"type": "string", "maxLength": 8}},
        {"json_object": True},
    ],
)
def test_masks_hold_only_ordinary_tokens(backend, tokenizer, spec):
    """Where the text of "<s>", "</s>" or "<unk>" fits, those special tokens stay barred
    (EOS too, until the output may end); ids past the tokenizer never appear."""
    compiled = compile_(backend, **spec)
    special = set(tokenizer.all_special_ids)
    for prefix in ("", "<", "<s", '"', '"<', "<unk"):
        m = backend.matcher(compiled, 0)
        if not m.accept_tokens(encode(tokenizer, prefix)):
            continue
        ids = allowed_tokens(backend, m)
        assert ids.size and ids[-1] < len(tokenizer)
        assert not (set(ids.tolist()) & special) - {tokenizer.eos_token_id}
        assert (tokenizer.eos_token_id in ids) == m.can_terminate()


def test_choice_of_special_token_texts_is_spelled_out(backend, tokenizer):
    compiled = compile_(backend, choice=["<s>"])
    m = backend.matcher(compiled, 0)
    assert not m.accept_tokens([tokenizer.convert_tokens_to_ids("<s>")])
    spelled = encode(tokenizer, "<") + encode(tokenizer, "s") + encode(tokenizer, ">")
    assert m.accept_tokens(spelled) and m.can_terminate()


def test_eos_only_once_the_output_must_end(backend, tokenizer):
    eos = tokenizer.eos_token_id
    compiled = compile_(backend, choice=["no", "nope"])
    m = backend.matcher(compiled, 0)
    assert m.accept_tokens(encode(tokenizer, "no"))
    ids = allowed_tokens(backend, m)
    assert eos in ids and len(ids) > 1 and m.can_terminate()
    assert m.accept_tokens(encode(tokenizer, "pe"))
    assert allowed_tokens(backend, m).tolist() == [eos]
    assert m.accept_tokens([eos]) and m.is_terminated() and not m.can_terminate()
    # a terminated matcher allows EOS alone, and accepts nothing more
    assert allowed_tokens(backend, m).tolist() == [eos]
    assert not m.accept_tokens([eos]) and m.validate_tokens([eos]) == 0


def test_empty_output(backend, tokenizer):
    m = backend.matcher(compile_(backend, choice=[""]), 0)
    assert m.can_terminate() and allowed_tokens(backend, m).tolist() == [tokenizer.eos_token_id]


def test_several_eos_tokens(tokenizer):
    """Every one of the model's EOS tokens ends the output, and none is text."""
    bos = tokenizer.bos_token_id
    backend = build_backend(tokenizer, eos_token_ids=(tokenizer.eos_token_id, bos))
    compiled = compile_(backend, regex="[a-z]{2}")
    for eos in (tokenizer.eos_token_id, bos):
        m = backend.matcher(compiled, 0)
        assert not set(allowed_tokens(backend, m).tolist()) & {tokenizer.eos_token_id, bos}
        assert m.accept_tokens(encode(tokenizer, "ab"))
        assert set(allowed_tokens(backend, m).tolist()) == {tokenizer.eos_token_id, bos}
        assert m.accept_tokens([eos]) and m.is_terminated()


def test_model_vocabulary_narrower_than_the_tokenizer(tokenizer):
    vocab_size = len(tokenizer) - 50
    backend = build_backend(tokenizer, vocab_size=vocab_size)
    m = backend.matcher(compile_(backend, json_object=True), 0)
    bitmask = new_bitmask(backend)
    assert bitmask.shape[1] == (vocab_size + 31) // 32
    for _ in range(6):
        m.fill_bitmask(bitmask, 0)
        ids = mask_ids(bitmask[0], bitmask.shape[1] * 32)
        assert ids.size and ids[-1] < vocab_size
        assert m.accept_tokens([int(ids[len(ids) // 2])])
    assert not m.accept_tokens([vocab_size + 3])


# matcher bookkeeping


def test_validate_does_not_move(backend, tokenizer):
    compiled = compile_(backend, json=OBJECT)
    tokens = encode(tokenizer, OBJECT_TEXT) + [tokenizer.eos_token_id]
    m = backend.matcher(compiled, 0)
    start = allowed_tokens(backend, m)
    assert m.validate_tokens(tokens) == len(tokens)
    assert m.validate_tokens(tokens + tokens[:1]) == len(tokens), "a token after EOS is validated"
    wrong = encode(tokenizer, '{"id": 4x')
    assert m.validate_tokens(wrong) == len(wrong) - 1
    assert m.validate_tokens([]) == 0
    assert np.array_equal(allowed_tokens(backend, m), start) and not m.is_terminated()
    assert m.accept_tokens(tokens[:5])
    after5 = allowed_tokens(backend, m)
    assert m.validate_tokens(tokens[5:]) == len(tokens) - 5
    assert np.array_equal(allowed_tokens(backend, m), after5)


def test_rollback_and_reset(backend, tokenizer):
    compiled = compile_(backend, json=OBJECT)
    tokens = encode(tokenizer, OBJECT_TEXT) + [tokenizer.eos_token_id]
    masks = []
    m = backend.matcher(compiled, 4)
    for t in tokens:
        masks.append(allowed_tokens(backend, m))
        assert m.accept_tokens([t])
    assert m.is_terminated()
    m.rollback(1)
    assert not m.is_terminated() and m.can_terminate()
    assert np.array_equal(allowed_tokens(backend, m), masks[-1])
    m.rollback(len(tokens) - 4)  # more than max_rollback: xgrammar keeps every step
    assert np.array_equal(allowed_tokens(backend, m), masks[3])
    assert m.accept_tokens(tokens[3:]) and m.is_terminated()
    with pytest.raises(ValueError):
        m.rollback(len(tokens) + 1)
    m.rollback(0)
    assert m.is_terminated()
    m.reset()
    assert np.array_equal(allowed_tokens(backend, m), masks[0]) and not m.is_terminated()
    with pytest.raises(ValueError):
        m.rollback(1)
    assert m.accept_tokens(tokens) and m.is_terminated()


def test_refused_token_keeps_the_matcher_after_the_ones_before(backend, tokenizer):
    compiled = compile_(backend, json=OBJECT)
    m = backend.matcher(compiled, 0)
    good = encode(tokenizer, '{"id": 1')
    assert not m.accept_tokens(good + encode(tokenizer, "x") + encode(tokenizer, "2"))
    reference = backend.matcher(compiled, 0)
    assert reference.accept_tokens(good)
    assert np.array_equal(allowed_tokens(backend, m), allowed_tokens(backend, reference))
    for bad in (-1, backend.vocab_size, backend.vocab_size + 100, len(tokenizer) + 1, tokenizer.eos_token_id):
        assert not m.accept_tokens([bad]) and m.validate_tokens([bad]) == 0
    assert m.accept_tokens(encode(tokenizer, '2, "tag": "a"}')) and m.can_terminate()


def test_matchers_of_one_compile_are_independent(backend, tokenizer):
    compiled = compile_(backend, json=OBJECT)
    tokens = encode(tokenizer, OBJECT_TEXT)
    a, b = backend.matcher(compiled, 0), backend.matcher(compiled, 0)
    start = allowed_tokens(backend, b)
    assert a.accept_tokens(tokens[:6])
    assert np.array_equal(allowed_tokens(backend, b), start)
    assert b.accept_tokens(tokens) and b.can_terminate() and not a.can_terminate()


# the batched fill


@pytest.mark.parametrize("max_threads", [1, 2, 4])
def test_batched_fill_writes_each_row_as_its_own_fill(tokenizer, max_threads):
    backend = build_backend(tokenizer, max_threads=max_threads)
    eos = tokenizer.eos_token_id
    plans = [
        ({"json": OBJECT}, '{"id": 4'),
        ({"json": OBJECT}, ""),
        ({"regex": "[a-c]+x"}, "ab"),
        ({"choice": ["alpha", "beta"]}, "al"),
        ({"grammar": 'root ::= "(" [0-9]+ ")"'}, "(1"),
        ({"json_object": True}, '{"k": ['),
    ]
    matchers = []
    for spec, text in plans:
        m = backend.matcher(compile_(backend, **spec), 0)
        assert m.accept_tokens(encode(tokenizer, text))
        matchers.append(m)
    done = backend.matcher(compile_(backend, choice=["z"]), 0)
    assert done.accept_tokens(encode(tokenizer, "z") + [eos]) and done.is_terminated()
    matchers.append(done)
    rows = [2 * i + 1 for i in range(len(matchers))][::-1]
    generator = torch.Generator().manual_seed(0)
    before = torch.randint(-(2**31), 2**31 - 1, (2 * len(matchers) + 1, new_bitmask(backend).shape[1]),
                           generator=generator, dtype=torch.int32)  # fmt: skip
    bitmask = before.clone()
    backend.fill_bitmask(matchers, bitmask, rows)
    for m, row in zip(matchers, rows):
        assert np.array_equal(mask_ids(bitmask[row], backend.vocab_size), allowed_tokens(backend, m)), row
    for row in set(range(bitmask.shape[0])) - set(rows):
        assert torch.equal(bitmask[row], before[row])
    # one matcher alone
    one = before.clone()
    backend.fill_bitmask(matchers[:1], one, [4])
    assert np.array_equal(mask_ids(one[4], backend.vocab_size), allowed_tokens(backend, matchers[0]))


# errors


INVALID = [
    ({"json": {"type": "nonsense"}}, "Invalid JSON schema"),
    ({"json": {"type": 12}}, "Invalid JSON schema"),
    ({"json": {"type": "object", "properties": {"a": 5}}}, "Invalid JSON schema"),
    ({"json": {"$ref": "#/$defs/missing"}}, "Invalid JSON schema"),
    ({"json": {"type": "integer", "minimum": 5, "maximum": 1}}, "Invalid JSON schema"),
    ({"json": {"type": "integer", "minimum": -(10**30)}}, "Invalid JSON schema"),
    ({"regex": "([a-z]"}, "Invalid regex"),
    ({"regex": "(?=a)b"}, "Invalid regex"),
    ({"regex": r"(a)\1"}, "Invalid regex"),
    ({"grammar": 'root ::= ("a" | "b"'}, "Invalid grammar"),
    ({"grammar": 'root ::= "a" undefined_rule'}, "Invalid grammar"),
    ({"grammar": 'start ::= "a"'}, "Invalid grammar"),
    ({"grammar": "root ::= [\\ud800-\\udfff]"}, "Invalid grammar"),
    ({"choice": ["ok", "\ud800"]}, "Invalid choice"),
]


@pytest.mark.parametrize(("spec", "prefix"), INVALID, ids=[str(i) for i in range(len(INVALID))])
def test_invalid_constraints_raise_constraint_errors(backend, spec, prefix):
    with pytest.raises(ConstraintError) as info:
        compile_(backend, **spec)
    message = str(info.value)
    assert message.startswith(prefix + ":"), message
    assert "/project/" not in message and ".cc:" not in message, f"xgrammar's log prefix left in: {message}"
    assert len(message) > len(prefix) + 5


def weather_tag(**change):
    structure = {"begin": "<tool=w>", "schema": {"type": "object"}, "end": "</tool>"}
    tag = {"structures": [structure], "triggers": ["<tool="]}
    for key, value in change.items():
        if key in structure:
            structure[key] = value
        else:
            tag[key] = value
    return tag


@pytest.mark.parametrize(
    ("tag", "needle"),
    [
        (weather_tag(triggers=["<fn="]), "starts with none of the triggers"),
        ({**weather_tag(), "triggers": ["<tool=", "<x"]}, "the trigger '<x' begins none"),
        (weather_tag(triggers=[]), "'triggers' must be"),
        (weather_tag(structures=[]), "'structures' must be"),
        (weather_tag(schema={"type": "nonsense"}), "Unsupported type"),
        (weather_tag(schema={"type": "array", "uniqueItems": True}), "uniqueItems"),
        (weather_tag(schema=3), "schema must be"),
        (weather_tag(begin=""), "non-empty string 'begin'"),
        ({"structures": [{"begin": "<a>", "end": "</a>"}], "triggers": ["<a"]}, "has no 'schema'"),
        ({**weather_tag(), "extra": 1}, "unknown key 'extra'"),
        (weather_tag(at_least_one="yes"), "'at_least_one' must be true or false, got 'yes'"),
        (weather_tag(stop_after_first=1), "'stop_after_first' must be true or false, got 1"),
        (weather_tag(at_least_one=True, stop_after_first=None), "'stop_after_first' must be true or false"),
        ({"type": "structural_tag", "format": {"type": "no_such_format"}}, "Invalid structural tag"),
        (
            {
                "type": "structural_tag",
                "format": {"type": "json_schema", "json_schema": {"type": "array", "uniqueItems": True}},
            },
            "uniqueItems",
        ),
    ],
)
def test_invalid_structural_tags(backend, tag, needle):
    with pytest.raises(ConstraintError) as info:
        compile_(backend, structural_tag=tag)
    assert str(info.value).startswith("Invalid structural tag"), str(info.value)
    assert needle in str(info.value)


def test_structural_tag_keys_reach_triggered_tags():
    """at_least_one and stop_after_first are passed to xgrammar's triggered_tags as given;
    without them its format is as before."""
    for keys in (
        {},
        {"at_least_one": True},
        {"stop_after_first": True},
        {"at_least_one": False, "stop_after_first": True},
    ):
        fmt = grammars.structural_tag_format(weather_tag(**keys), lambda schema: 'root ::= "{}"')["format"]
        assert set(fmt) == {"type", "triggers", "tags", *keys}, fmt
        assert {k: fmt[k] for k in keys} == keys


UNENFORCED = [
    ({"type": "array", "uniqueItems": True}, "'uniqueItems' (at the root)"),
    ({"type": "number", "multipleOf": 0.5}, "'multipleOf'"),
    ({"type": "object", "properties": {"a": {"not": {"type": "null"}}}}, "'not' (at /properties/a)"),
    ({"if": {"type": "string"}, "then": {"maxLength": 2}}, "'if' / 'then' / 'else'"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "'dependentRequired'"),
    ({"type": "array", "items": {"contains": {"const": 1}}}, "'contains' (at /items)"),
    ({"allOf": [{"type": "string"}, {"maxLength": 3}]}, "'allOf' of more than one schema"),
    ({"$defs": {"s": {"type": "string", "pattern": "^(?!a)"}}, "$ref": "#/$defs/s"}, "Lookahead"),
    ({"type": "object", "patternProperties": {"(?<=x)": {}}}, "patternProperties"),
]


@pytest.mark.parametrize(("schema", "needle"), UNENFORCED, ids=[str(i) for i in range(len(UNENFORCED))])
def test_unenforced_schema_keywords_are_refused_unless_lenient(backend, tokenizer, schema, needle):
    with pytest.raises(ConstraintError) as info:
        compile_(backend, json=schema)
    assert str(info.value).startswith("Invalid JSON schema: the xgrammar backend does not enforce")
    assert needle in str(info.value)
    lenient = build_backend(tokenizer, config={"lenient": True})
    if "Lookahead" in needle or "patternProperties" in needle:
        return  # xgrammar cannot parse those patterns at all, or ignores the lookaround
    lenient.compile(P(json=schema))


def test_supported_keywords_compile(backend):
    for schema in (
        {"type": "integer", "multipleOf": 3},
        {"allOf": [{"$ref": "#/$defs/a"}], "$defs": {"a": {"type": "string"}}},
        {"type": "object", "properties": {"not": {"type": "string"}, "if": {"type": "integer"}}},
        {"enum": [{"not": 1}, {"if": 2}]},
        {"type": "object", "patternProperties": {"^x[0-9]$": {"type": "integer"}}, "additionalProperties": False},
        {"type": "string", "format": "date-time"},
    ):
        compile_(backend, json=schema)


# settings


@pytest.mark.parametrize(
    "config",
    [
        {"nope": 1},
        {"lenient": "yes"},
        {"strict_mode": 1},
        {"max_whitespace": 0},
        {"max_threads": 0},
        {"cache_limit_mb": -2},
    ],
)
def test_bad_settings_are_refused(tokenizer, config):
    with pytest.raises(ValueError) as info:
        build_backend(tokenizer, config=config)
    assert next(iter(config)) in str(info.value)


def test_max_whitespace_and_strict_mode(tokenizer):
    space = encode(tokenizer, " ")
    assert len(space) == 1
    backend = build_backend(tokenizer, config={"max_whitespace": 2, "strict_mode": False})
    m = backend.matcher(compile_(backend, json={"type": "object", "properties": {"a": {"type": "integer"}}}), 0)
    assert m.accept_tokens(encode(tokenizer, "{") + space * 2)
    assert not m.accept_tokens(space)
    # without strict mode, properties the schema does not name may come
    assert m.accept_tokens(encode(tokenizer, '"b": true}')) and m.can_terminate()
    strict = build_backend(tokenizer)
    m = strict.matcher(compile_(strict, json={"type": "object", "properties": {"a": {"type": "integer"}}}), 0)
    tokens = encode(tokenizer, '{"b"')
    assert m.validate_tokens(tokens) < len(tokens)


def test_schema_depth_is_bounded(tokenizer):
    """xgrammar's conversion time grows with about the cube of a schema's depth: deeper than
    max_schema_depth is refused before it starts."""

    def nested(depth):
        schema = {"type": "integer"}
        for _ in range(depth - 1):
            schema = {"type": "array", "items": schema, "maxItems": 1}
        return schema

    backend = build_backend(tokenizer, config={"max_schema_depth": 8})
    backend.compile(P(json=nested(8)))
    with pytest.raises(ConstraintError, match="more than 8 deep"):
        backend.compile(P(json=nested(9)))
    tag = {"structures": [{"begin": "<a>", "schema": nested(9), "end": "</a>"}], "triggers": ["<a>"]}
    with pytest.raises(ConstraintError, match="more than 8 deep"):
        backend.compile(P(structural_tag=tag))
    default = build_backend(tokenizer)
    with pytest.raises(ConstraintError, match="more than 128 deep"):
        default.compile(P(json=nested(129)))
    # a value nested past Python's recursion limit is an error of the constraint, too
    deep_value: list = []
    for _ in range(5000):
        deep_value = [deep_value]
    with pytest.raises(ConstraintError, match="nested too deeply"):
        default.compile(P(json={"const": deep_value}))


def test_compile_cache_setting(tokenizer):
    backend = build_backend(tokenizer, config={"cache_limit_mb": 16})
    first = backend.compile(P(json=OBJECT))
    second = backend.compile(P(json=OBJECT))
    assert np.array_equal(
        allowed_tokens(backend, backend.matcher(first, 0)), allowed_tokens(backend, backend.matcher(second, 0))
    )
    backend.close()


@pytest.mark.parametrize(
    "spec",
    [
        {"regex": "(a{0,1000}){0,1000}"},
        {"regex": "[a-z]{1,100000}"},
        {"regex": "(a|aa)*(x+x+)+y"},
        {"regex": "(.*a){30}"},
        {"grammar": "root ::= r0\n" + "\n".join(f"r{i} ::= r{i + 1}" for i in range(3000)) + '\nr3000 ::= "a"'},
        {"json": {"type": "string", "minLength": 5000, "maxLength": 100000}},
        {"json": {"type": "integer", "minimum": -(10**15), "maximum": 10**15}},
    ],
    ids=["nested-counted", "long-counted", "ambiguous", "dot-star-30", "rule-chain", "long-string", "wide-range"],
)
def test_pathological_constraints_compile_quickly(backend, tokenizer, spec):
    """Constraints that are slow for backtracking or automaton-building matchers compile in
    well under a second with xgrammar, and fill masks in milliseconds."""
    import time

    started = time.perf_counter()
    compiled = backend.compile(P(**spec))
    assert time.perf_counter() - started < 10
    m = backend.matcher(compiled, 0)
    for _ in range(10):
        started = time.perf_counter()
        ids = allowed_tokens(backend, m)
        assert time.perf_counter() - started < 1
        ids = ids[ids != tokenizer.eos_token_id]
        if not ids.size:
            break
        assert m.accept_tokens([int(ids[0])])


def test_too_deep_nesting_is_an_error(backend):
    with pytest.raises(ConstraintError, match="Invalid grammar: .*Nest layer exceeded"):
        backend.compile(P(grammar="root ::= " + "(" * 5000 + '"a"' + ")" * 5000))
    with pytest.raises(ConstraintError, match="Invalid regex: .*Nest layer exceeded"):
        backend.compile(P(regex="(" * 5000 + "a" + ")" * 5000))


def test_no_eos_in_the_vocabulary_is_refused(tokenizer):
    with pytest.raises(ValueError, match="EOS"):
        build_backend(tokenizer, eos_token_ids=(10**6,))


# concurrency


def test_concurrent_compiles_match_a_compile_alone(backend, tokenizer):
    specs = [
        {"json": OBJECT},
        {"regex": "[a-z]{2,5}@[a-z]{2,4}\\.(com|net)"},
        {"grammar": 'root ::= "(" [0-9]+ ("," [0-9]+)* ")"'},
        {"choice": ["red", "green", "blue"]},
        {"json": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 4}},
        {"structural_tag": weather_tag()},
    ] * 2
    barrier = threading.Barrier(len(specs))
    results = [None] * len(specs)

    def work(i):
        barrier.wait()
        try:
            results[i] = backend.compile(P(**specs[i]))
        except BaseException as exc:  # reported below
            results[i] = exc

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(specs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    for spec, compiled in zip(specs, results):
        assert not isinstance(compiled, BaseException) and compiled is not None, compiled
        alone = backend.compile(P(**spec))
        assert np.array_equal(
            allowed_tokens(backend, backend.matcher(compiled, 0)), allowed_tokens(backend, backend.matcher(alone, 0))
        )


# the rewrites of xgrammar's grammars


def test_unpatched_json_grammars_are_xgrammars_own(backend, tokenizer, walker):
    """Where nothing needs a rewrite, the backend's masks are those of xgrammar's own
    compile_json_schema: the grammar's printed form reads back as the same grammar."""
    import random

    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "number", "minimum": -2, "maximum": 9},
            "kind": {"enum": ["a", "b", None]},
            "items": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
            "id": {"type": "string", "format": "uuid"},
        },
        "required": ["n", "kind"],
        "additionalProperties": False,
    }
    own = backend.compiler.compile_json_schema(schema, any_whitespace=True)
    ours = backend.compile(P(json=schema))
    rng = random.Random(0)
    for _ in range(4):
        walk = walker.walk(ours, rng)
        m = xgr.GrammarMatcher(own)
        replay = backend.matcher(ours, 0)
        for token in walk.tokens:
            bitmask = new_bitmask(backend)
            m.fill_next_token_bitmask(bitmask, 0)
            assert np.array_equal(mask_ids(bitmask[0], backend.vocab_size), allowed_tokens(backend, replay))
            assert m.accept_token(token) and replay.accept_tokens([token])


def test_exclude_surrogates():
    ex = grammars.exclude_surrogates
    assert ex('root ::= "[^a]" [^a] # [^b] comment\n') == 'root ::= "[^a]" [^a\\ud800-\\udfff] # [^b] comment\n'
    assert ex("root ::= [^\\ud800-\\udfffx]") == "root ::= [^\\ud800-\\udfffx]"  # already excludes them
    assert ex("root ::= [\\0-\\U0010ffff]") == "root ::= [\\u0000-\\ud7ff\\ue000-\\U0010ffff]"
    assert ex("root ::= [a-z\\-\\]]") == "root ::= [a-z\\-\\]]"  # no surrogate: unchanged
    assert ex("root ::= [\\ud7ff-\\ue000\\]]") == "root ::= [\\ud7ff\\ue000\\]]"
    assert ex("root ::= [^a") == "root ::= [^a"  # unreadable: left to xgrammar's parser
    assert ex('root ::= "a\\"[^" [^"]') == 'root ::= "a\\"[^" [^\\"\\ud800-\\udfff]'
    with pytest.raises(ConstraintError):
        ex("root ::= [\\ud900-\\udaff]")


def test_python_regex():
    py = grammars.python_regex
    assert py("a.b") == "a[^\\n\\ud800-\\udfff]b"
    assert py(r"\.[.][^.]") == r"\.[.][^.\ud800-\udfff]"
    assert py(r"[]a.]\D\d") == r"[]a.][^\d\ud800-\udfff]\d"
    assert py(r"[^]x]\W\S\s") == r"[^]x\ud800-\udfff][^\w\ud800-\udfff][^\s\ud800-\udfff]\s"
    assert py(r"[\]^.]") == r"[\]^.]"
    # positive classes spanning the surrogates are spelled out without them
    assert py(r"[\u0000-\uffff]") == r"[\u{0}-\u{d7ff}\u{e000}-\u{ffff}]"
    assert py(r"[\^a]") == r"[\^a]"  # no surrogate: as written
    with pytest.raises(ConstraintError):
        py(r"[\ud800-\udbff]")


def test_no_surrogates_where_any_character_may_come(backend, tokenizer):
    """Bytes ED A0-BF (a UTF-16 surrogate's encoding) never follow one another where any
    character may come: negated classes, ".", [\\s\\S], JSON strings, GBNF classes."""
    byte = byte_tokens(tokenizer)
    ed, a0, x80, nine_f = byte[0xED], byte[0xA0], byte[0x80], byte[0x9F]
    for spec, prefix in (
        ({"regex": "[\\s\\S]+"}, ""),
        ({"regex": "[\\u0000-\\uffff]+"}, ""),
        ({"regex": ".+"}, ""),
        ({"regex": "[^a]+"}, ""),
        ({"regex": "\\W+"}, ""),
        ({"grammar": "root ::= [\\0-\\U0010ffff]+"}, ""),
        ({"grammar": 'root ::= "(" [^()]+ ")"'}, "("),
        ({"json": {"type": "string"}}, '"'),
        ({"json": {"type": "string", "pattern": "^.+$"}}, '"'),
        ({"json_object": True}, '{"'),
    ):
        m = backend.matcher(compile_(backend, **spec), 0)
        assert m.accept_tokens(encode(tokenizer, prefix))
        assert m.validate_tokens([ed, a0, x80]) < 3, spec
        assert m.validate_tokens([ed, nine_f, x80]) == 3, spec  # U+D7C0, a character


def test_patch_json_strings():
    loose = 'root_characters ::= (([^\\"\\\\\\r\\n]))\nother ::= (([^\\"\\\\\\r\\n] "x"))'
    patched = grammars.patch_json_strings(loose)
    assert patched.splitlines()[0] == 'root_characters ::= (([^\\0-\\x1f\\"\\\\\\r\\n]))'
    assert patched.splitlines()[1] == loose.splitlines()[1]
