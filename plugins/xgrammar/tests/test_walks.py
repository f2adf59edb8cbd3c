"""Random walks through the masks of each constraint kind, every finished output judged by
an independent reference: ``jsonschema`` (and strict ``json.loads``) for JSON,
``re.fullmatch`` for regexes and for GBNF grammars (through a Python regex of the same
language), membership for choices, and a scan with ``json.JSONDecoder.raw_decode`` for
structural tags."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine.sampling_params import StructuredOutputsParams as P
from engine.testing.kit.structured_output import whitespace_outside_strings

WALKS = 12


def strict_json(text: str):
    """``json.loads`` without NaN / Infinity, and refusing raw control characters in strings."""

    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


SCHEMAS = {
    "nested_objects": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "minLength": 1, "maxLength": 6},
                    "address": {
                        "type": "object",
                        "properties": {
                            "zip": {"type": "string", "pattern": "^[0-9]{3}$"},
                            "country": {"enum": ["FR", "DE", "US"]},
                        },
                        "required": ["zip", "country"],
                        "additionalProperties": False,
                    },
                },
                "required": ["name", "address"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
        "additionalProperties": False,
    },
    "bounded_arrays": {
        "type": "object",
        "properties": {
            "scores": {
                "type": "array",
                "items": {"type": "integer", "minimum": -3, "maximum": 7},
                "minItems": 2,
                "maxItems": 4,
            },
            "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 1},
        },
        "required": ["scores", "flags"],
        "additionalProperties": False,
    },
    "optional_fields_and_numbers": {
        "type": "object",
        "properties": {
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
            "temperature": {"type": "number", "exclusiveMinimum": -10.5, "exclusiveMaximum": 40},
            "count": {"type": "integer", "minimum": 100, "maximum": 999},
            "label": {"type": ["string", "null"], "maxLength": 3},
            "mode": {"const": "fast"},
        },
        "required": ["ratio"],
        "additionalProperties": False,
    },
    "any_of_and_refs": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}, "y": {"$ref": "#/$defs/coord"}},
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "coord": {"type": "integer", "minimum": -9, "maximum": 9},
        },
        "type": "array",
        "items": {
            "anyOf": [{"$ref": "#/$defs/point"}, {"type": "string", "pattern": "^[a-c]{1,2}$"}, {"type": "null"}]
        },
        "maxItems": 3,
    },
    "strings_with_escapes": {
        "type": "object",
        "properties": {"text": {"type": "string"}, "short": {"type": "string", "maxLength": 2}},
        "required": ["text", "short"],
        "additionalProperties": False,
    },
}


@pytest.mark.parametrize("name", SCHEMAS)
@pytest.mark.parametrize("disable_any_whitespace", [False, True], ids=["whitespace", "compact"])
def test_json_schema_walks_validate(walker, name, disable_any_whitespace):
    schema = SCHEMAS[name]
    jsonschema.Draft202012Validator.check_schema(schema)
    texts = walker.texts(P(json=schema, disable_any_whitespace=disable_any_whitespace), WALKS, seed=len(name))
    for text in texts:
        jsonschema.validate(strict_json(text), schema)
        if disable_any_whitespace:
            assert not whitespace_outside_strings(text), f"whitespace in {text!r}"


def test_json_object_walks_are_objects(walker):
    for compact in (False, True):
        for text in walker.texts(P(json_object=True, disable_any_whitespace=compact), WALKS, seed=3):
            assert isinstance(strict_json(text), dict), text
            if compact:
                assert not whitespace_outside_strings(text), f"whitespace in {text!r}"


def test_bounded_strings_hold_no_raw_control_characters(walker):
    """xgrammar's own rule for length-bounded strings lets raw control characters through;
    the backend's does not (a walk is drawn toward them)."""
    schema = {"type": "array", "items": {"type": "string", "minLength": 2, "maxLength": 4}, "maxItems": 3}
    compiled = walker.backend.compile(P(json=schema))
    controls = [t for t in range(walker.vocab) if any(ord(c) < 0x20 for c in walker.tokenizer.decode([t]))]
    assert controls
    m = walker.backend.matcher(compiled, 0)
    assert m.accept_tokens(walker.tokenizer.encode('["', add_special_tokens=False))
    assert m.validate_tokens(controls[:1]) == 0
    for text in walker.texts(P(json=schema), WALKS, seed=11):
        jsonschema.validate(strict_json(text), schema)
    # the same through a structural tag's JSON
    tag = {"structures": [{"begin": "<a>", "schema": schema, "end": "</a>"}], "triggers": ["<a>"]}
    m = walker.backend.matcher(walker.backend.compile(P(structural_tag=tag)), 0)
    assert m.accept_tokens(walker.tokenizer.encode('<a>["', add_special_tokens=False))
    assert m.validate_tokens(controls[:1]) == 0


REGEXES = [
    r"[a-z]{1,4}@(example|test)\.(com|org)",
    r"-?(0|[1-9][0-9]{0,2})(\.[0-9]{1,3})?",
    r"(ab|cd)*e?",
    r"\d{3}-\w{2}",
    r"[^\n]{0,5}\n?x",
    r"(a|b).{1,3}c",  # "." is Python's: no newline
    r"[\[\]\\^-]{1,3}\.\*",
]


@pytest.mark.parametrize("regex", REGEXES)
def test_regex_walks_fullmatch(walker, regex):
    texts = walker.texts(P(regex=regex), WALKS, seed=len(regex))
    for text in texts:
        assert re.fullmatch(regex, text), f"{text!r} does not match {regex!r}"


def test_regex_dot_refuses_a_newline(backend, tokenizer):
    m = backend.matcher(backend.compile(P(regex="a.b")), 0)
    assert m.accept_tokens(tokenizer.encode("a", add_special_tokens=False))
    assert m.validate_tokens(tokenizer.encode("\nb", add_special_tokens=False)) == 0
    assert m.validate_tokens(tokenizer.encode("\rb", add_special_tokens=False)) == 2
    # a "." inside a class, and an escaped one, stay what they are
    m = backend.matcher(backend.compile(P(regex=r"[.]\.")), 0)
    assert m.validate_tokens(tokenizer.encode("..", add_special_tokens=False)) == 2
    m = backend.matcher(backend.compile(P(regex=r"[.]\.")), 0)
    assert m.validate_tokens(tokenizer.encode("a.", add_special_tokens=False)) == 0


CHOICES = [
    ("yes", "no", "maybe so"),
    ('say "hi"', "back\\slash", "C:\\path\\", "tab\there"),
    ("a.*b", "(x|y)", "[0-9]+", "^$", "{1,2}", "a?b"),
    ("café", "naïve", "日本語", "emoji 😀", "Ωmega"),
    ("on", "one", "only"),  # choices that are prefixes of one another
    ("\\u0041", "'single'", "new\nline", "nul\x00byte"),
]


@pytest.mark.parametrize("choices", CHOICES, ids=range(len(CHOICES)))
def test_choice_walks_are_choices(walker, tokenizer, choices):
    texts = walker.texts(P(choice=list(choices)), 30, seed=7, eos_bias=0.3)
    assert set(texts) <= set(choices), set(texts) - set(choices)
    assert len(set(texts)) > 1
    # each choice is a complete output, and only the choices are
    backend = walker.backend
    compiled = backend.compile(P(choice=list(choices)))
    for choice in choices:
        m = backend.matcher(compiled, 0)
        tokens = tokenizer.encode(choice, add_special_tokens=False)
        assert m.accept_tokens(tokens), choice
        assert m.can_terminate() and m.accept_tokens([tokenizer.eos_token_id]) and m.is_terminated()
    m = backend.matcher(compiled, 0)
    wrong = tokenizer.encode(choices[0] + "!", add_special_tokens=False)
    assert m.validate_tokens(wrong) < len(wrong)


GRAMMARS = [
    ('root ::= "(" [0-9]+ ("," [0-9]+)* ")"', r"\([0-9]+(,[0-9]+)*\)"),
    (
        'root ::= greeting " " name "!"\ngreeting ::= "hi" | "hello"\nname ::= [A-Z] [a-z]*\n',
        r"(hi|hello) [A-Z][a-z]*!",
    ),
    (
        'root ::= item ("; " item)*\nitem ::= [a-c]{1,3} "=" ("yes" | "no")',
        r"[a-c]{1,3}=(yes|no)(; [a-c]{1,3}=(yes|no))*",
    ),
    ('root ::= "\\"" [^"\\\\]* "\\""  # a quoted string', r'"[^"\\]*"'),
]


@pytest.mark.parametrize(("grammar", "regex"), GRAMMARS, ids=range(len(GRAMMARS)))
def test_grammar_walks_match_their_language(walker, grammar, regex):
    for text in walker.texts(P(grammar=grammar), WALKS, seed=5):
        assert re.fullmatch(regex, text, re.DOTALL), f"{text!r} is not in the language of {grammar!r}"


WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 6}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
TAG = {
    "structures": [
        {"begin": "<tool=weather>", "schema": WEATHER, "end": "</tool>"},
        {"begin": "<tool=time>", "schema": TIME, "end": "</tool>"},
    ],
    "triggers": ["<tool="],
}


def segments(text: str) -> list[tuple[str, object]]:
    """Every ``<tool=NAME>JSON</tool>`` segment of ``text`` (the JSON parsed), found by a scan;
    fails on a trigger not followed by a whole segment."""
    found, start, decoder = [], 0, json.JSONDecoder()
    while (i := text.find("<tool=", start)) >= 0:
        close = text.index(">", i)
        name = text[i + len("<tool=") : close]
        value, end = decoder.raw_decode(text, close + 1)
        assert text.startswith("</tool>", end), f"no </tool> after the JSON in {text[i:]!r}"
        found.append((name, value))
        start = end + len("</tool>")
    return found


def test_structural_tag_walks(walker, tokenizer, backend):
    schemas = {"weather": WEATHER, "time": TIME}
    texts = walker.texts(P(structural_tag=TAG), 16, seed=2, max_tokens=250, eos_bias=0.1)
    assert texts
    for text in texts:
        for name, value in segments(text):
            jsonschema.validate(value, schemas[name])
    # a chosen text, token by token: free text, a segment, free text
    full = 'see <tool=weather>{"city": "Oslo", "days": 3}</tool> and <tool=time>{"zone":"UTC"}</tool>.'
    m = backend.matcher(backend.compile(P(structural_tag=TAG)), 0)
    assert m.accept_tokens(tokenizer.encode(full, add_special_tokens=False))
    assert m.can_terminate()
    m = backend.matcher(backend.compile(P(structural_tag=TAG)), 0)
    bad = tokenizer.encode('<tool=weather>{"city": "Oslo", "days": 9}', add_special_tokens=False)
    assert m.validate_tokens(bad) < len(bad)
    bad = tokenizer.encode("<tool=wind>", add_special_tokens=False)
    assert m.validate_tokens(bad) < len(bad)


def test_structural_tag_in_xgrammars_format(backend, tokenizer):
    """A structural tag already in xgrammar's own format is passed through."""
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": ["<f>"],
            "tags": [{"type": "tag", "begin": "<f>", "content": {"type": "regex", "pattern": "[0-9]+"}, "end": "</f>"}],
        },
    }
    m = backend.matcher(backend.compile(P(structural_tag=tag)), 0)
    assert m.accept_tokens(tokenizer.encode("x <f>12</f> y", add_special_tokens=False)) and m.can_terminate()
    m.reset()
    inside = tokenizer.encode("<f>1", add_special_tokens=False)
    assert m.validate_tokens(inside + tokenizer.encode("a", add_special_tokens=False)) == len(inside)
