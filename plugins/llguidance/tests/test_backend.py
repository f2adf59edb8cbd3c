"""The llguidance backend's contract: registration, refusals as ConstraintError, the
matcher's accept / validate / rollback / reset semantics against a replay reference, the
tokens a mask may never hold, batched fills, and compiles that are concurrent, deep,
large or pathological."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from engine.interfaces.structured_output import ConstraintError, bitmask_width
from engine.sampling_params import StructuredOutputsParams as P

from .conftest import EXTRA_IDS, allowed_tokens, backend_class, build_backend


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def mask_of(backend, matcher) -> torch.Tensor:
    bitmask = torch.zeros(1, bitmask_width(backend.vocab_size), dtype=torch.int32)
    matcher.fill_bitmask(bitmask, 0)
    return bitmask[0]


# registration


def test_registered_through_the_entry_point():
    cls = backend_class()
    assert cls.__name__ == "LLGuidanceBackend" and cls.name == "llguidance"
    assert cls.supported_kinds == {"json", "json_object", "regex", "choice", "grammar", "structural_tag"}


def test_plugin_module_imports_nothing_heavy():
    code = (
        "import sys, engine_llguidance.plugin\n"
        "heavy = [m for m in ('torch', 'llguidance', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# refusals


STRUCTURAL_TAG = {"structures": [{"begin": "<a>", "schema": {}, "end": "</a>"}], "triggers": ["<a"]}

INVALID = [
    (P(regex="(a"), "regex", "unclosed group"),
    (P(regex="(?=a)b"), "regex", "look-around"),
    (P(regex=r"(a)\1"), "regex", "backreferences"),
    (P(json={"type": "array", "contains": {"type": "integer"}}), "json", "contains"),
    (P(json={"if": {"type": "string"}, "then": {"minLength": 2}}), "json", '"if"'),
    (P(json={"type": "object", "unevaluatedProperties": False}), "json", "unevaluatedProperties"),
    (P(json={"type": "string", "format": "no-such-format"}), "json", "no-such-format"),
    (P(json={"type": "wat"}), "json", "wat"),
    (P(json={"$ref": "#/$defs/missing"}), "json", "missing"),
    (P(json={"type": "integer", "minimum": 5, "maximum": 2}), "json", "minimum"),
    (P(json={"type": "string", "pattern": "(x"}), "json", "unclosed group"),
    (P(json="false"), "json", "false"),
    (P(grammar='root ::= item\nother ::= "x"'), "grammar", "item"),
    (P(grammar='root ::= ("a"'), "grammar", "GBNF"),
    (P(grammar='start ::= "a"'), "grammar", "root"),
    (P(grammar="start: foo"), "grammar", "foo"),
    (
        P(structural_tag={"structures": [{"begin": "<a>", "schema": {}, "end": "</a>"}], "triggers": ["<b"]}),
        "structural_tag",
        "<b",
    ),
    (P(structural_tag={"triggers": ["<a"]}), "structural_tag", "structures"),
    (
        P(structural_tag={"structures": [{"begin": "<a>", "schema": {}, "end": "</a>"}], "triggers": []}),
        "structural_tag",
        "triggers",
    ),
    (
        P(structural_tag={"structures": [{"begin": "<a>", "end": "</a>"}], "triggers": [""]}),
        "structural_tag",
        "non-empty",
    ),
    (P(structural_tag={"structures": [{"begin": "<a>", "schema": {}}], "triggers": ["<a"]}), "structural_tag", "end"),
    (
        P(structural_tag={"structures": [{"begin": "<a>", "schema": 3, "end": "</a>"}], "triggers": ["<a"]}),
        "structural_tag",
        "schema",
    ),
    (
        P(
            structural_tag={
                "structures": [{"begin": "<a>", "schema": {"type": "array", "contains": {}}, "end": "</a>"}],
                "triggers": ["<a"],
            }
        ),
        "structural_tag",
        "contains",
    ),
    (P(structural_tag={"format": {}, "type": "structural_tag"}), "structural_tag", "structures"),
    (
        P(structural_tag={**STRUCTURAL_TAG, "at_least_one": "yes"}),
        "structural_tag",
        "'at_least_one' must be true or false, got 'yes'",
    ),
    (
        P(structural_tag={**STRUCTURAL_TAG, "stop_after_first": 1}),
        "structural_tag",
        "'stop_after_first' must be true or false, got 1",
    ),
    (
        P(structural_tag={**STRUCTURAL_TAG, "at_least_one": True, "stop_after_first": None}),
        "structural_tag",
        "'stop_after_first' must be true or false",
    ),
    (P(structural_tag={**STRUCTURAL_TAG, "at_least_once": True}), "structural_tag", "at_least_once"),
]


@pytest.mark.parametrize("constraint, kind, reason", INVALID, ids=[f"{k}-{i}" for i, (_, k, _) in enumerate(INVALID)])
def test_invalid_constraints_raise_constraint_error(backend, constraint, kind, reason):
    with pytest.raises(ConstraintError) as info:
        backend.compile(constraint)
    message = str(info.value)
    assert kind in message and reason in message, message


def test_unsupported_keywords_compile_when_lenient(tokenizer):
    lenient = build_backend(tokenizer, config={"lenient": True})
    compiled = lenient.compile(P(json={"type": "array", "contains": {"type": "integer"}}))
    assert any("contains" in w for w in compiled.warnings)
    matcher = lenient.matcher(compiled, 0)
    assert matcher.accept_tokens(encode(tokenizer, '["x", 1]') + [tokenizer.eos_token_id])


@pytest.mark.parametrize(
    "config, word",
    [
        ({"colour": "blue"}, "colour"),
        ({"lenient": "yes"}, "lenient"),
        ({"limits": {"max_lexer_states": 0}}, "max_lexer_states"),
        ({"limits": {"fuel": 3}}, "fuel"),
        ({"limits": {"verbose_errors": 1}}, "verbose_errors"),
        ({"limits": []}, "limits"),
    ],
)
def test_bad_settings_are_named(tokenizer, config, word):
    with pytest.raises(ValueError, match=word):
        build_backend(tokenizer, config=config)


def test_limits_apply(tokenizer):
    tight = build_backend(tokenizer, config={"limits": {"max_grammar_size": 50}, "max_threads": 1})
    with pytest.raises(ConstraintError, match="grammar"):
        tight.compile(P(json={"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(100)}}))


# matcher semantics


def replay(backend, compiled, tokens):
    """A fresh matcher that accepted ``tokens`` one at a time: the reference state."""
    matcher = backend.matcher(compiled, 0)
    for token in tokens:
        assert matcher.accept_tokens([token])
    return matcher


def test_accept_stops_after_the_allowed_prefix(backend, tokenizer):
    compiled = backend.compile(P(regex="[a-c]{1,8}x"))
    matcher = backend.matcher(compiled, 0)
    good, bad = encode(tokenizer, "abc"), encode(tokenizer, "z")
    assert not matcher.accept_tokens(good + bad + good)
    assert torch.equal(mask_of(backend, matcher), mask_of(backend, replay(backend, compiled, good)))
    assert matcher.accept_tokens(encode(tokenizer, "x") + [tokenizer.eos_token_id])
    assert matcher.is_terminated()


def test_validate_counts_without_moving(backend, tokenizer):
    compiled = backend.compile(P(json={"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}))
    matcher = backend.matcher(compiled, 0)
    prefix = encode(tokenizer, '{"n"')
    assert matcher.accept_tokens(prefix)
    before = mask_of(backend, matcher)
    eos = tokenizer.eos_token_id
    for text, extra in [
        (": 12}", []),
        (": 12}", [eos]),
        (": 12}", [eos, eos]),
        (": 1x2}", []),
        (': "1"}', []),
        ("", [eos]),
    ]:
        tokens = encode(tokenizer, text) + extra
        expected = 0
        reference = replay(backend, compiled, prefix)
        for token in tokens:
            if not reference.accept_tokens([token]):
                break
            expected += 1
        assert matcher.validate_tokens(tokens) == expected, text
        assert torch.equal(mask_of(backend, matcher), before)
        assert not matcher.is_terminated()


def test_rollback_restores_every_earlier_state(backend, tokenizer):
    compiled = backend.compile(P(json={"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 3}))
    tokens = encode(tokenizer, '["ab", "c"]') + [tokenizer.eos_token_id]
    matcher = backend.matcher(compiled, len(tokens))
    masks = [mask_of(backend, matcher)]
    for token in tokens:
        assert matcher.accept_tokens([token])
        masks.append(mask_of(backend, matcher))
    assert matcher.is_terminated()
    for back in (1, 3, len(tokens)):
        matcher.rollback(back)
        assert not matcher.is_terminated()
        assert torch.equal(mask_of(backend, matcher), masks[len(tokens) - back])
        assert matcher.accept_tokens(tokens[len(tokens) - back :])
        assert matcher.is_terminated()
    with pytest.raises(ValueError):
        matcher.rollback(len(tokens) + 1)


@pytest.mark.parametrize("regex, text", [("ab", "ab"), ("a+", "aaa")], ids=["complete", "may_go_on"])
def test_eos_ends_the_constraint_and_rolls_back(backend, tokenizer, regex, text):
    # "ab": after it the grammar cannot go on (llguidance stops); "a+": it could
    compiled = backend.compile(P(regex=regex))
    matcher = backend.matcher(compiled, 2)
    tokens = encode(tokenizer, text)
    eos = tokenizer.eos_token_id
    assert matcher.accept_tokens(tokens)
    assert matcher.can_terminate() and not matcher.is_terminated()
    assert eos in allowed_tokens(backend, matcher)
    assert matcher.validate_tokens([eos, eos]) == 1
    assert matcher.accept_tokens([eos])
    assert matcher.is_terminated()
    assert not matcher.accept_tokens([eos]) and not matcher.accept_tokens(tokens[:1])
    assert matcher.validate_tokens([eos]) == 0
    matcher.rollback(1)
    assert not matcher.is_terminated() and matcher.can_terminate()
    assert matcher.accept_tokens([eos]) and matcher.is_terminated()
    matcher.rollback(2)
    assert torch.equal(mask_of(backend, matcher), mask_of(backend, replay(backend, compiled, tokens[:-1])))


def test_only_eos_once_the_output_must_end(backend, tokenizer):
    matcher = backend.matcher(backend.compile(P(choice=["yes", "no"])), 0)
    assert matcher.accept_tokens(encode(tokenizer, "yes"))
    assert allowed_tokens(backend, matcher).tolist() == [tokenizer.eos_token_id]


def test_eos_not_allowed_before_the_output_may_end(backend, tokenizer):
    matcher = backend.matcher(backend.compile(P(regex="abc")), 0)
    assert matcher.accept_tokens(encode(tokenizer, "ab"))
    assert not matcher.can_terminate()
    assert tokenizer.eos_token_id not in allowed_tokens(backend, matcher)
    assert matcher.validate_tokens([tokenizer.eos_token_id]) == 0
    assert not matcher.accept_tokens([tokenizer.eos_token_id])
    assert matcher.accept_tokens(encode(tokenizer, "c") + [tokenizer.eos_token_id])


def test_reset_returns_to_the_start(backend, tokenizer):
    compiled = backend.compile(P(json_object=True))
    matcher = backend.matcher(compiled, 0)
    start = mask_of(backend, matcher)
    assert matcher.accept_tokens(encode(tokenizer, "{}") + [tokenizer.eos_token_id])
    matcher.reset()
    assert not matcher.is_terminated() and not matcher.can_terminate()
    assert torch.equal(mask_of(backend, matcher), start)
    assert not matcher.accept_tokens(encode(tokenizer, "[]"))
    matcher.reset()
    assert matcher.accept_tokens(encode(tokenizer, '{"a": [1, {"b": null}]}') + [tokenizer.eos_token_id])


def test_matchers_of_one_compile_are_independent(backend, tokenizer):
    compiled = backend.compile(P(regex="(ab|cd)+"))
    first, second = backend.matcher(compiled, 0), backend.matcher(compiled, 0)
    assert first.accept_tokens(encode(tokenizer, "ab"))
    assert second.accept_tokens(encode(tokenizer, "cdcd"))
    assert torch.equal(mask_of(backend, first), mask_of(backend, replay(backend, compiled, encode(tokenizer, "ab"))))


# tokens a mask never holds


def test_ids_beyond_the_tokenizer_and_special_tokens_are_never_allowed(backend, tokenizer):
    vocab = len(tokenizer)
    assert backend.vocab_size == vocab + EXTRA_IDS
    special = sorted(set(tokenizer.all_special_ids) - {tokenizer.eos_token_id})
    # free text allows every ordinary token; a Lark grammar may even name special tokens
    for constraint in (P(regex=r"(.|\n)*"), P(grammar="start: (<s> | <unk> | <[%d]> | /./)*" % (vocab + 3))):
        matcher = backend.matcher(backend.compile(constraint), 0)
        ids = allowed_tokens(backend, matcher)
        assert len(ids) > vocab // 2
        assert ids.max() < vocab
        assert not set(special) & set(ids.tolist())
        for token in special + [vocab, vocab + 3, backend.vocab_size - 1]:
            assert matcher.validate_tokens([token]) == 0
            assert not matcher.accept_tokens([token])
        assert matcher.accept_tokens(encode(tokenizer, "still fine") + [tokenizer.eos_token_id])


def test_padding_bits_of_the_last_word_stay_clear(backend):
    matcher = backend.matcher(backend.compile(P(regex=r"(.|\n)*")), 0)
    row = mask_of(backend, matcher)
    bits = np.unpackbits(row.numpy().view(np.uint8), bitorder="little")
    assert not bits[backend.vocab_size :].any()


def test_every_eos_token_ends_the_output(tokenizer):
    eos = (tokenizer.eos_token_id, len(tokenizer) + 5)  # a second EOS id the model has beyond the tokenizer
    backend = build_backend(tokenizer, eos_token_ids=eos)
    compiled = backend.compile(P(regex="ok"))
    for token in eos:
        matcher = backend.matcher(compiled, 0)
        assert not set(eos) & set(allowed_tokens(backend, matcher).tolist())
        assert matcher.accept_tokens(encode(tokenizer, "ok"))
        assert allowed_tokens(backend, matcher).tolist() == sorted(eos)
        assert matcher.accept_tokens([token]) and matcher.is_terminated()


def test_logits_narrower_than_the_tokenizer(tokenizer):
    vocab_size = len(tokenizer) - 9
    narrow = build_backend(tokenizer, vocab_size=vocab_size)
    compiled = narrow.compile(P(regex=r"[a-z ]{0,20}"))
    matchers = [narrow.matcher(compiled, 0) for _ in range(2)]
    assert matchers[1].accept_tokens(encode(tokenizer, "ab"))
    bitmask = torch.full((3, bitmask_width(vocab_size)), -1, dtype=torch.int32)
    narrow.fill_bitmask(matchers, bitmask, [2, 0])
    assert torch.equal(bitmask[1], torch.full_like(bitmask[1], -1))  # a row not asked for is left alone
    for row in (0, 2):
        bits = np.unpackbits(bitmask[row].numpy().view(np.uint8), bitorder="little")
        assert bits.any() and not bits[vocab_size:].any()
    assert torch.equal(bitmask[2], mask_of(narrow, matchers[0]))
    for token in range(vocab_size, len(tokenizer)):
        assert matchers[0].validate_tokens([token]) == 0


# batches


def test_batched_fill_equals_one_by_one(backend, tokenizer):
    constraints = [
        P(json_object=True),
        P(regex="[0-9]+"),
        P(choice=["alpha", "beta"]),
        P(grammar='root ::= "x"+'),
        P(json_object=True),
    ]
    prefixes = ["{", "12", "al", "xx", ""]
    matchers = []
    for constraint, prefix in zip(constraints, prefixes):
        matcher = backend.matcher(backend.compile(constraint), 0)
        assert matcher.accept_tokens(encode(tokenizer, prefix))
        matchers.append(matcher)
    rows = [6, 0, 3, 4, 1]
    bitmask = torch.full((7, bitmask_width(backend.vocab_size)), 12345, dtype=torch.int32)
    backend.fill_bitmask(matchers, bitmask, rows)
    for matcher, row in zip(matchers, rows):
        assert torch.equal(bitmask[row], mask_of(backend, matcher)), row
    for untouched in (2, 5):
        assert (bitmask[untouched] == 12345).all()


# compiles


def test_concurrent_compiles(backend, tokenizer):
    constraints = [P(regex=f"x{{{i}}}y") for i in range(1, 13)] + [
        P(json={"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]})
        for i in range(12)
    ]
    results: dict[int, object] = {}
    errors: list[BaseException] = []

    def work(offset):
        try:
            for i in range(offset, len(constraints), 4):
                results[i] = backend.compile(constraints[i])
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(results) == len(constraints)
    for i in range(12):
        text = "x" * (i + 1) + "y"
        assert backend.matcher(results[i], 0).accept_tokens(encode(tokenizer, text) + [tokenizer.eos_token_id])
        assert backend.matcher(results[12 + i], 0).accept_tokens(
            encode(tokenizer, '{"k%d": 7}' % i) + [tokenizer.eos_token_id]
        )


def test_a_deep_chain_of_rules_does_not_overflow_the_stack(backend, tokenizer):
    # a few thousand levels of rule references overflow a default 8 MiB thread stack in
    # llguidance's compiler; the backend compiles on a thread with a larger one
    depth = 5000
    lark = "\n".join(f'r{i}: "a" r{i + 1} | "b"' for i in range(depth)) + f'\nr{depth}: "z"\nstart: r0\n'
    matcher = backend.matcher(backend.compile(P(grammar=lark)), 0)
    assert matcher.accept_tokens(encode(tokenizer, "aaab") + [tokenizer.eos_token_id])


def test_pathological_regexes_compile_and_match_quickly(backend, tokenizer):
    for regex, text, tail in [("(a+)+b", "a" * 300, "b"), ("(a|aa)*c{1000}", "a" * 300, "c" * 1000)]:
        started = time.perf_counter()
        matcher = backend.matcher(backend.compile(P(regex=regex)), 0)
        assert matcher.accept_tokens(encode(tokenizer, text))
        mask_of(backend, matcher)
        assert (
            matcher.validate_tokens(encode(tokenizer, tail) + [tokenizer.eos_token_id])
            == len(encode(tokenizer, tail)) + 1
        )
        assert time.perf_counter() - started < 5.0, regex


def test_a_large_grammar_compiles(backend, tokenizer):
    words = [f"w{i:05d}" + "x" * 20 for i in range(10000)]  # about 270 KB of alternatives
    grammar = "root ::= " + " | ".join(json.dumps(w) for w in words)
    started = time.perf_counter()
    compiled = backend.compile(P(grammar=grammar))
    assert time.perf_counter() - started < 20.0
    matcher = backend.matcher(compiled, 0)
    assert matcher.accept_tokens(encode(tokenizer, words[7777]) + [tokenizer.eos_token_id])


def test_gbnf_and_lark_notation(backend, tokenizer):
    gbnf = r"""root ::= greeting " " name
greeting ::= "hi" | "h\u00e9llo" | "\U0001F600"
name ::= [A-Z] [a-z\u00e0-\u00ff]*"""
    compiled = backend.compile(P(grammar=gbnf))
    for text in ("hi Bob", "héllo Zoé", "😀 X"):
        assert backend.matcher(compiled, 0).accept_tokens(encode(tokenizer, text) + [tokenizer.eos_token_id]), text
    # a GBNF rule named start is still GBNF
    compiled = backend.compile(P(grammar='root ::= start "!"\nstart ::= "go"'))
    assert backend.matcher(compiled, 0).accept_tokens(encode(tokenizer, "go!") + [tokenizer.eos_token_id])
    lark = 'start: item ("," item)*\nitem: /[0-9]+/ | "none"'
    compiled = backend.compile(P(grammar=lark))
    assert backend.matcher(compiled, 0).accept_tokens(encode(tokenizer, "1,none,23") + [tokenizer.eos_token_id])


def test_structural_tag_triggers_are_text(backend, tokenizer):
    tag = {
        "structures": [
            {
                "begin": "<tool>",
                "schema": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
                "end": "</tool>",
            }
        ],
        "triggers": ["<tool>"],
    }
    eos = tokenizer.eos_token_id
    first, stop = {"at_least_one": True}, {"stop_after_first": True}
    for compact, keys, text, ok in [
        (False, {}, 'look: <tool>{"q": "x"}</tool> done', True),
        (True, {}, 'look: <tool>{"q":"x"}</tool> done', True),
        (True, {}, 'look: <tool>{"q": "x"}</tool> done', False),
        (False, {}, "look: <tool>nope</tool>", False),
        (False, {}, "no call at all", True),
        (True, first, '<tool>{"q":"x"}</tool> then <tool>{"q":"y"}</tool>', True),
        (True, first, '<tool>{"q": "x"}</tool>', False),
        (False, first, 'look: <tool>{"q": "x"}</tool>', False),
        (False, first, '<tool>{"q": "x"}</tool> then <tool>nope</tool>', False),
        (True, stop, 'look: <tool>{"q":"x"}</tool>', True),
        (True, stop, 'look: <tool>{"q": "x"}</tool>', False),
        (False, stop, 'look: <tool>{"q": "x"}</tool> done', False),
        (False, stop, "no call at all", True),
        (True, {**first, **stop}, '<tool>{"q":"x"}</tool>', True),
        (False, {**first, **stop}, '<tool>{"q": "x"}</tool> ', False),
    ]:
        constraint = P(structural_tag={**tag, **keys}, disable_any_whitespace=compact)
        matcher = backend.matcher(backend.compile(constraint), 0)
        tokens = encode(tokenizer, text) + [eos]
        assert (matcher.validate_tokens(tokens) == len(tokens)) is ok, (keys, compact, text)


def test_structural_tag_starts_at_the_shortest_trigger(backend, tokenizer):
    tag = {
        "structures": [{"begin": "<function=f>", "schema": {"type": "integer"}, "end": "</function>"}],
        "triggers": ["<function=", "<fun"],
    }
    matcher = backend.matcher(backend.compile(P(structural_tag=tag)), 0)
    # "<fun" is a trigger: once it appears, the structure must follow
    tokens = encode(tokenizer, "a <fun fact")
    assert matcher.validate_tokens(tokens) < len(tokens)
    assert matcher.accept_tokens(encode(tokenizer, "a <function=f>42</function> b") + [tokenizer.eos_token_id])


def test_json_kinds_accept_what_they_should(backend, tokenizer):
    eos = tokenizer.eos_token_id
    cases = [
        (P(json_object=True), ['{"a": {"b": [1, 2.5, "x", true, null]}}', "{}"], ["[]", '"x"', "1"]),
        (P(json="true"), ["[1]", '"s"', "null"], ["nul"]),
        (P(json='{"type": "string", "enum": ["a\\"b", "c"]}'), ['"a\\"b"', '"c"'], ['"a"', '"ab"']),
    ]
    for constraint, good, bad in cases:
        compiled = backend.compile(constraint)
        for text in good:
            assert backend.matcher(compiled, 0).accept_tokens(encode(tokenizer, text) + [eos]), text
        for text in bad:
            tokens = encode(tokenizer, text) + [eos]
            assert backend.matcher(compiled, 0).validate_tokens(tokens) < len(tokens), text
