"""Random walks through the masks of each constraint kind, every finished output checked
against an independent reference: ``jsonschema`` for JSON, ``re.fullmatch`` for regexes,
the list for choices, a hand-written parser for a GBNF grammar, and a scan with
``json.JSONDecoder.raw_decode`` for structural tags."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from engine.sampling_params import StructuredOutputsParams as P
from engine.testing.kit.structured_output import whitespace_outside_strings

JSON_WHITESPACE = " \t\n\r"


SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "minLength": 1, "maxLength": 5},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
            "nickname": {"type": ["string", "null"], "maxLength": 4},
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "arrays": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"enum": ["red", "green", 'bl"ue', 3, None]},
                "minItems": 1,
                "maxItems": 3,
            },
            "matrix": {
                "type": "array",
                "items": {"type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 9}, "maxItems": 2},
                "minItems": 2,
                "maxItems": 2,
            },
        },
        "required": ["tags", "matrix"],
        "additionalProperties": False,
    },
    "numbers": {
        "type": "array",
        "items": {"type": "number", "minimum": -2.5, "exclusiveMaximum": 10},
        "minItems": 2,
        "maxItems": 4,
    },
    "choices": {
        "anyOf": [
            {"type": "object", "properties": {"kind": {"const": "a"}, "x": {"type": "boolean"}}, "required": ["kind"]},
            {"type": "string", "pattern": "^id-[a-f0-9]{2,4}$"},
            {"type": "integer", "minimum": 10, "maximum": 99},
        ]
    },
    "defs": {
        "$defs": {"leaf": {"type": "object", "properties": {"v": {"type": "integer", "maximum": 5, "minimum": 0}}}},
        "type": "object",
        "properties": {
            "left": {"$ref": "#/$defs/leaf"},
            "right": {"$ref": "#/$defs/leaf"},
            "flag": {"type": "boolean"},
        },
        "required": ["left"],
    },
}


@pytest.mark.parametrize("compact", [False, True], ids=["any_whitespace", "compact"])
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_walks_validate(walker, tokenizer, name, compact):
    schema = SCHEMAS[name]
    walks = walker.walks(P(json=schema, disable_any_whitespace=compact), 12, seed=hash(name) % 1000 + compact)
    done = [w for w in walks if w.ended]
    assert len(done) >= len(walks) // 2, f"only {len(done)} of {len(walks)} walks ended"
    for walk in done:
        text = walk.text(tokenizer)
        jsonschema.validate(json.loads(text), schema)
        if compact:
            assert not whitespace_outside_strings(text), repr(text)


def test_flexible_whitespace_is_allowed_and_compact_refuses_it(backend, tokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}}}}
    spaced = '{ "a" : [ 1 ,\n 2 ] }'
    for compact, accepted in ((False, True), (True, False)):
        matcher = backend.matcher(backend.compile(P(json=schema, disable_any_whitespace=compact)), 0)
        ids = tokenizer.encode(spaced, add_special_tokens=False)
        assert (matcher.validate_tokens(ids) == len(ids)) is accepted
    # a schema's own llguidance options do not bring whitespace back into compact JSON
    own = {**schema, "x-guidance": {"whitespace_pattern": " +", "item_separator": ", "}}
    matcher = backend.matcher(backend.compile(P(json=own, disable_any_whitespace=True)), 0)
    ids = tokenizer.encode('{"a": [1, 2]}', add_special_tokens=False)
    assert matcher.validate_tokens(ids) < len(ids)
    assert matcher.accept_tokens(tokenizer.encode('{"a":[1,2]}', add_special_tokens=False) + [tokenizer.eos_token_id])


def test_json_object_walks(walker, tokenizer):
    for compact in (False, True):
        walks = walker.walks(P(json_object=True, disable_any_whitespace=compact), 10, seed=7 + compact)
        done = [w for w in walks if w.ended]
        assert done
        for walk in done:
            assert isinstance(json.loads(walk.text(tokenizer)), dict)


REGEXES = [
    r"[a-z]{2,5}@[a-z]{1,4}\.(com|org)",
    r"[0-9]{3}-[0-9]{4}",
    r"(ab|cd)*e?",
    r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?",
    r"[^\n]{0,6}x",
    r"é+[αβγ]{1,3}",
    r"(a+)+b",
    r'"([^"\\]|\\.){0,5}"',
]


@pytest.mark.parametrize("regex", REGEXES)
def test_regex_walks_fullmatch(walker, tokenizer, regex):
    walks = walker.walks(P(regex=regex), 12, seed=len(regex), max_tokens=60)
    done = [w for w in walks if w.ended]
    assert len(done) >= len(walks) // 2
    for walk in done:
        assert re.fullmatch(regex, walk.text(tokenizer)), (regex, walk.text(tokenizer))


CHOICES = ['a"b', "back\\slash", ".*+?[](){}|^$", "é😀中", "line\nbreak\ttab", "/slash/", "", "red", "redder"]


def test_choice_walks_and_every_choice_is_reachable(walker, backend, tokenizer):
    constraint = P(choice=CHOICES)
    for walk in walker.walks(constraint, 25, seed=3, eos_bias=0.5):
        assert walk.ended and walk.text(tokenizer) in CHOICES
    compiled = backend.compile(constraint)
    for choice in CHOICES:
        matcher = backend.matcher(compiled, 0)
        assert matcher.accept_tokens(tokenizer.encode(choice, add_special_tokens=False) + [tokenizer.eos_token_id])
        assert matcher.is_terminated()
    for other in ("ab", "re", "reddest", 'a"b ', "."):
        matcher = backend.matcher(compiled, 0)
        ids = tokenizer.encode(other, add_special_tokens=False) + [tokenizer.eos_token_id]
        assert matcher.validate_tokens(ids) < len(ids)


ARITHMETIC = r"""
# arithmetic over small integers
root   ::= expr
expr   ::= term (("+" | "-") term)*
term   ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= [0-9] [0-9]? [0-9]?
"""


def parse_arithmetic(text: str) -> bool:
    """A recursive-descent recognizer of :data:`ARITHMETIC`."""
    pos = 0

    def number() -> bool:
        nonlocal pos
        start = pos
        while pos < len(text) and text[pos].isdigit() and text[pos] in "0123456789" and pos - start < 3:
            pos += 1
        return pos > start

    def factor() -> bool:
        nonlocal pos
        if pos < len(text) and text[pos] == "(":
            pos += 1
            if not expr() or pos >= len(text) or text[pos] != ")":
                return False
            pos += 1
            return True
        return number()

    def chain(item, ops) -> bool:
        nonlocal pos
        if not item():
            return False
        while pos < len(text) and text[pos] in ops:
            pos += 1
            if not item():
                return False
        return True

    def term() -> bool:
        return chain(factor, "*/")

    def expr() -> bool:
        return chain(term, "+-")

    return expr() and pos == len(text)


def test_gbnf_walks_parse(walker, tokenizer):
    walks = walker.walks(P(grammar=ARITHMETIC), 20, seed=11, max_tokens=80, eos_bias=0.4)
    done = [w for w in walks if w.ended]
    assert len(done) >= 10
    for walk in done:
        assert parse_arithmetic(walk.text(tokenizer)), walk.text(tokenizer)


def test_gbnf_literals_and_classes(walker, backend, tokenizer):
    grammar = r"""root ::= "say \"" word ("\\" | "\n") "\u00e9" [^a-z"\\\n]{1,2}
word ::= [a-c]+"""
    reference = re.compile(r'say "[a-c]+(\\|\n)é[^a-z"\\\n]{1,2}')
    walks = walker.walks(P(grammar=grammar), 15, seed=5, max_tokens=40)
    done = [w for w in walks if w.ended]
    assert done
    for walk in done:
        assert reference.fullmatch(walk.text(tokenizer)), repr(walk.text(tokenizer))


STRUCTURAL = {
    "structures": [
        {
            "begin": "<function=get>",
            "schema": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}},
                "required": ["id"],
                "additionalProperties": False,
            },
            "end": "</function>",
        },
        {
            "begin": "<function=put>",
            "schema": {
                "type": "object",
                "properties": {"v": {"enum": ["x", "y"]}},
                "required": ["v"],
                "additionalProperties": False,
            },
            "end": "</function>",
        },
        {"begin": "[[note:", "schema": {"type": "string", "maxLength": 3}, "end": "]]"},
    ],
    "triggers": ["<function=", "[["],
}


def check_structural(text: str, tag: dict) -> int:
    """Scan ``text``: every trigger starts one structure's ``begin + JSON + end``. Returns
    how many segments there were; raises AssertionError on a violation."""
    decoder = json.JSONDecoder()
    triggers = tag["triggers"]
    pos, segments = 0, 0
    while True:
        found = [(text.find(t, pos), t) for t in triggers if text.find(t, pos) >= 0]
        if not found:
            return segments
        start, _ = min(found)
        candidates = [s for s in tag["structures"] if text.startswith(s["begin"], start)]
        assert candidates, f"a trigger at {start} starts no structure: {text!r}"
        errors = []
        for structure in candidates:
            at = start + len(structure["begin"])
            while at < len(text) and text[at] in JSON_WHITESPACE:
                at += 1
            try:
                value, at = decoder.raw_decode(text, at)
                jsonschema.validate(value, structure["schema"])
            except (ValueError, jsonschema.ValidationError) as exc:
                errors.append(exc)
                continue
            while at < len(text) and text[at] in JSON_WHITESPACE:
                at += 1
            if text.startswith(structure["end"], at):
                pos = at + len(structure["end"])
                segments += 1
                break
            errors.append(f"no end at {at}")
        else:
            raise AssertionError(f"segment at {start} of {text!r}: {errors}")


def test_structural_tag_walks(walker, backend, tokenizer):
    compiled = backend.compile(P(structural_tag=STRUCTURAL))
    inject = [tokenizer.encode(t, add_special_tokens=False) for t in ("<function=", "[[", "<func", "[")]
    rng = random.Random(17)
    segments = 0
    for _ in range(30):
        matcher = backend.matcher(compiled, 0)
        tokens: list[int] = []
        for _step in range(120):
            if matcher.can_terminate() and rng.random() < 0.05:
                assert matcher.accept_tokens([tokenizer.eos_token_id])
                tokens.append(tokenizer.eos_token_id)
                break
            sequence = rng.choice(inject)
            if rng.random() < 0.15 and matcher.validate_tokens(sequence) == len(sequence):
                assert matcher.accept_tokens(sequence)
                tokens.extend(sequence)
                continue
            before = len(tokens)
            walk = walker.walk_step(matcher, rng)
            tokens.append(walk)
            assert len(tokens) == before + 1
            if matcher.is_terminated():
                break
        if tokens and tokens[-1] == tokenizer.eos_token_id:
            segments += check_structural(tokenizer.decode(tokens[:-1]), STRUCTURAL)
    assert segments >= 3, "the walks hardly ever entered a structure"
