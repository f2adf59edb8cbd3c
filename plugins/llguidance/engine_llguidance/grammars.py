"""Constraints (:class:`~engine.sampling_params.StructuredOutputsParams`) as llguidance
grammar definitions: the text ``llguidance.LLMatcher`` compiles.

Nothing here checks a grammar against llguidance's own rules (that is the matcher's
construction, in :mod:`engine_llguidance.backend`); a constraint whose shape is wrong
before llguidance sees it (a structural tag without structures, a GBNF grammar that does
not parse) raises :class:`~engine.interfaces.structured_output.ConstraintError` here.
"""

from __future__ import annotations

import json
import re
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark

from engine.interfaces.structured_output import ConstraintError

# JSON written without whitespace between its tokens: the compiler's separators, and no
# whitespace pattern (a schema's own "x-guidance" options cannot bring any back)
COMPACT_JSON = {"whitespace_flexible": False, "whitespace_pattern": None, "item_separator": ",", "key_separator": ":"}

# a GBNF rule: a name, then ::= (Lark writes "name:"; it never uses ::=)
_GBNF_RULE = re.compile(r"(?m)^[ \t]*[A-Za-z0-9_-]+[ \t]*::=")
# what only Lark has: llguidance's header, or the start rule
_LARK = re.compile(r"(?m)^\s*(%llguidance\b|start\s*:)")
# a GBNF escape: \uXXXX, \UXXXXXXXX, or a backslash and any one character
_ESCAPE = re.compile(r"\\(u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|.)", re.DOTALL)
# GBNF's lexical pieces: a comment, a string literal, a character class, a name (or a
# number), anything else one character at a time
_GBNF_PIECE = re.compile(r'#[^\r\n]*|"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[A-Za-z0-9_-]+|.', re.DOTALL)
_NAME = re.compile(r"[A-Za-z_-][A-Za-z0-9_-]*")


def json_options(disable_any_whitespace: bool, lenient: bool) -> tuple[dict | None, dict | None]:
    """The JSON compiler's (defaults, overrides): flexible whitespace unless disabled;
    unsupported keywords refused unless ``lenient``."""
    defaults = {"lenient": True} if lenient else None
    overrides = dict(COMPACT_JSON) if disable_any_whitespace else None
    return defaults, overrides


def json_schema_grammar(schema: Any, disable_any_whitespace: bool, lenient: bool) -> str:
    """A JSON value that validates against ``schema`` (a dict, or a boolean schema)."""
    if isinstance(schema, bool):
        if not schema:
            raise ConstraintError("The json constraint is the schema false, which no value satisfies.")
        schema = {}
    if not isinstance(schema, dict):
        raise ConstraintError(f"The json constraint must be a JSON Schema object, got {type(schema).__name__}.")
    defaults, overrides = json_options(disable_any_whitespace, lenient)
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=defaults, overrides=overrides)
    except (ValueError, TypeError, RecursionError) as exc:
        raise ConstraintError(f"The json constraint's schema cannot be read: {exc}") from None


def regex_grammar(regex: str) -> str:
    """The whole output matches ``regex`` (llguidance's regex syntax is Rust's ``regex``
    crate's: no look-around, no backreferences)."""
    return llguidance.LLMatcher.grammar_from_regex(regex)


def choice_grammar(choices: tuple[str, ...] | list[str]) -> str:
    """The output is exactly one of ``choices``: each a Lark string literal, so quotes,
    backslashes, regex metacharacters, control characters and any Unicode stand for
    themselves (JSON string escapes are what Lark's literals read). The choices are one
    lexeme: the lexer tells them apart, so thousands of them cost the parser nothing
    (as alternatives of a rule, more than ``max_items_in_row`` of them would fail)."""
    if not choices:
        raise ConstraintError("The choice constraint needs at least one choice.")
    return llguidance.LLMatcher.grammar_from_lark(
        "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in dict.fromkeys(choices))
    )


def is_gbnf(text: str) -> bool:
    """Whether ``text`` is GBNF (``root ::= ...``) rather than Lark (``start: ...``)."""
    return _GBNF_RULE.search(text) is not None or _LARK.search(text) is None


def ebnf_grammar(text: str) -> str:
    """A GBNF grammar (llama.cpp notation, rooted at ``root``), or a Lark grammar (rooted at
    ``start``, as llguidance writes it) passed through unchanged."""
    if is_gbnf(text):
        try:
            text = gbnf_to_lark(_plain_unicode_escapes(_wrap_root(text)))
        except RecursionError:
            raise ConstraintError("The grammar constraint is nested too deeply.") from None
        except Exception as exc:  # the converter's own error type, and plain Exception for missing rules
            raise ConstraintError(f"The grammar constraint is not valid GBNF: {exc}") from None
    return llguidance.LLMatcher.grammar_from_lark(text)


def _normal_name(name: str) -> str:
    """A GBNF rule's name as llguidance's converter writes it in Lark (case aside)."""
    return re.sub(r"([a-z])([A-Z])", r"\1_\2", name.replace("-", "_")).lower()


def _wrap_root(text: str) -> str:
    """``text`` with its ``root`` rule renamed and a new ``root`` that only refers to it, and
    any rule the converter would name ``start`` renamed.

    The converter turns ``root`` into Lark's ``start``, so a GBNF rule of its own named
    ``start`` would clash; and ``start`` is the one rule it never makes a lexeme, so a
    root that is all terminals (a long list of literal alternatives) would be a parser
    row of that many items, which fails past ``max_items_in_row``. Under the new root, the
    old one is a rule like any other: a lexeme when it is all terminals.
    """
    pieces = _GBNF_PIECE.findall(text)
    names = {p for p in pieces if _NAME.fullmatch(p)}
    if "root" not in names:
        return text  # the converter says what is missing
    taken = {_normal_name(n) for n in names}

    def fresh(stem: str) -> str:
        i = 0
        while f"{stem}_{i}" in taken:
            i += 1
        taken.add(f"{stem}_{i}")
        return f"{stem}_{i}"

    renames = {n: fresh("gbnf_start") for n in sorted(names) if _normal_name(n) == "start"}
    renames["root"] = fresh("gbnf_root")
    body = "".join(renames.get(p, p) for p in pieces)
    return f"{body}\nroot ::= {renames['root']}\n"


def _plain_unicode_escapes(text: str) -> str:
    """GBNF's ``\\uXXXX`` and ``\\UXXXXXXXX`` escapes as ones llguidance's converter carries
    over intact: ``\\xHH`` for ASCII, the character itself above it (the converter drops
    their leading zeros, which Lark's string literals do not read)."""

    def plain(match: re.Match) -> str:
        escape = match.group(1)
        if escape[0] not in "uU" or len(escape) == 1:
            return match.group(0)
        code = int(escape[1:], 16)
        if code < 0x80:
            return f"\\x{code:02x}"
        if 0xD800 <= code < 0xE000 or code > 0x10FFFF:  # not a character: left for the converter to refuse
            return match.group(0)
        return chr(code)

    return _ESCAPE.sub(plain, text)


STRUCTURAL_TAG_FLAGS = ("at_least_one", "stop_after_first")


def structural_tag_grammar(tag: Any, disable_any_whitespace: bool, lenient: bool) -> str:
    """Free text in which every trigger starts a segment ``begin + JSON + end``.

    ``tag`` is ``{"structures": [{"begin": str, "schema": {...}, "end": str}, ...],
    "triggers": [str, ...]}``, and optionally the booleans ``at_least_one`` (the output
    begins with a segment, no text before it) and ``stop_after_first`` (the output ends
    right after its first segment). Each structure's ``begin`` must start with one of the
    triggers; the shortest such trigger is the one the text meets first, so it is the one
    that starts the structure. Triggers are matched as text, never as special tokens.
    """
    if not isinstance(tag, dict):
        raise ConstraintError("The structural_tag constraint must be a JSON object.")
    unknown = sorted(set(tag) - {"structures", "triggers", "type", *STRUCTURAL_TAG_FLAGS})
    if unknown or tag.get("type", "structural_tag") != "structural_tag":
        raise ConstraintError(
            'The structural_tag constraint must be {"structures": [{"begin": ..., "schema": {...}, "end": ...}], '
            f'"triggers": [...]}} (and optionally "at_least_one", "stop_after_first"); got the keys {sorted(tag)}.'
        )
    for flag in STRUCTURAL_TAG_FLAGS:
        if not isinstance(tag.get(flag, False), bool):
            raise ConstraintError(f"The structural_tag constraint's {flag!r} must be true or false, got {tag[flag]!r}.")
    at_least_one, stop_after_first = tag.get("at_least_one", False), tag.get("stop_after_first", False)
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise ConstraintError("The structural_tag constraint needs a non-empty list 'structures'.")
    if not isinstance(triggers, list) or not triggers:
        raise ConstraintError("The structural_tag constraint needs a non-empty list 'triggers'.")
    for trigger in triggers:
        if not isinstance(trigger, str) or not trigger:
            raise ConstraintError(
                f"The structural_tag constraint's triggers must be non-empty strings, got {trigger!r}."
            )
    defaults, overrides = json_options(disable_any_whitespace, lenient)
    tags = []
    for i, structure in enumerate(structures):
        if not isinstance(structure, dict) or not {"begin", "end"} <= set(structure):
            raise ConstraintError(
                f"The structural_tag constraint's structure {i} must be an object with 'begin', 'schema' and 'end'."
            )
        begin, end, schema = structure["begin"], structure["end"], structure.get("schema", {})
        if not isinstance(begin, str) or not isinstance(end, str):
            raise ConstraintError(f"The structural_tag constraint's structure {i}: 'begin' and 'end' must be strings.")
        if isinstance(schema, bool):
            if not schema:
                raise ConstraintError(f"The structural_tag constraint's structure {i} has the schema false.")
            schema = {}
        if not isinstance(schema, dict):
            raise ConstraintError(
                f"The structural_tag constraint's structure {i}: 'schema' must be a JSON Schema object."
            )
        matching = [t for t in triggers if begin.startswith(t)]
        if not matching:
            raise ConstraintError(
                f"The structural_tag constraint's structure {i} begins with {begin!r}, which starts with none of "
                f"the triggers {triggers!r}."
            )
        tags.append(
            llguidance.StructTag(
                trigger=min(matching, key=len), begin=begin, grammar=_with_options(schema, defaults, overrides), end=end
            )
        )
    try:
        if not (at_least_one or stop_after_first):
            return llguidance.StructTag.to_grammar(tags, assume_special=False)
        return _forcing_tags_lark(tags, at_least_one, stop_after_first)
    except (AssertionError, ValueError, TypeError, RecursionError) as exc:
        raise ConstraintError(f"The structural_tag constraint cannot be compiled: {exc}") from None


def _forcing_tags_lark(tags: list[llguidance.StructTag], at_least_one: bool, stop_after_first: bool) -> str:
    """The Lark grammar of ``tags`` with ``at_least_one`` and / or ``stop_after_first``, in
    the shape of ``StructTag.to_grammar``'s: free text is the lexeme ``TAG_TEXT``, and a
    segment met in it starts with a lazy lexeme of text up to the first occurrence of its
    trigger, so that the text holds a trigger only where a segment starts.

    - at_least_one: a segment first (its ``begin`` written out), then free text with
      segments, as without either key;
    - stop_after_first: free text, then at most one segment, which ends the output;
    - both: exactly one segment, and nothing else.
    """
    rules = []
    if at_least_one:  # segments at the very start
        for i, tag in enumerate(tags):
            rules.append(f"first_{i}: {_literal(tag.begin)} %json {json.dumps(tag.grammar)} {_literal(tag.end)}")
    if not (at_least_one and stop_after_first):  # segments met in free text
        for i, tag in enumerate(tags):
            rules.append(f"tag_{i}_trig[lazy]: TAG_TEXT {_literal(tag.trigger)}")
            rules.append(
                f"tag_{i}: tag_{i}_trig {_literal(tag.begin[len(tag.trigger) :])} "
                f"%json {json.dumps(tag.grammar)} {_literal(tag.end)}"
            )
    first = " | ".join(f"first_{i}" for i in range(len(tags)))
    triggered = " | ".join(f"tag_{i}" for i in range(len(tags)))
    if at_least_one and stop_after_first:
        start = f"start: {first}"
    elif at_least_one:
        start = f"start: ({first}) ({triggered})* TAG_TEXT"
    else:
        start = f"start: TAG_TEXT | {triggered}"
    return "\n".join(["%llguidance {}", start, "TAG_TEXT: /(.|\\n)*/", *rules]) + "\n"


def _literal(text: str) -> str:
    """``text`` as a Lark string literal; nothing for the empty string (Lark has no empty literal)."""
    return json.dumps(text) if text else ""


def _with_options(schema: dict, defaults: dict | None, overrides: dict | None) -> dict:
    """``schema`` with the JSON compiler's options in its "x-guidance" (a schema inside a
    Lark grammar takes its options from there only)."""
    if defaults is None and overrides is None:
        return schema
    own = schema.get("x-guidance")
    options = {**(defaults or {}), **(own if isinstance(own, dict) else {}), **(overrides or {})}
    return {**schema, "x-guidance": options}
