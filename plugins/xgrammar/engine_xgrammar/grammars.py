"""Constraints as xgrammar grammars: what each kind of StructuredOutputsParams becomes, the
checks xgrammar does not make itself, and xgrammar's errors as ConstraintErrors.

xgrammar is trusted with parsing (JSON Schema, regex, EBNF) and with matching; what is
added here is what keeps its outputs inside the constraint as the engine defines it:

- JSON Schema keywords that xgrammar 0.2.9 ignores (its output may then break them) are
  refused, unless the backend is lenient (:func:`unsupported_keywords`).
- Its strings bounded by ``minLength`` / ``maxLength`` (and property names bounded by
  ``propertyNames``) admit raw control characters, which JSON forbids: those rules are
  rewritten to the character class of its other strings (:func:`patch_json_strings`).
- A regex's ``.`` is Python's: any character but a newline (:func:`python_regex`).
- No character class allows a UTF-16 surrogate, which xgrammar would emit as invalid
  UTF-8 (:func:`exclude_surrogates`, :func:`python_regex`).
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any, Iterator

import xgrammar as xgr

from engine.interfaces.structured_output import ConstraintError

MAX_REASON_CHARS = 2000  # of xgrammar's message quoted in a ConstraintError

# "[23:21:02] /project/cpp/regex_converter.cc:94: " before each of xgrammar's messages
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+?:\d+: ")

# xgrammar's JSON string character class of length-bounded strings, and the one of its
# unbounded strings (basic_string_sub), which keeps out the control characters
_LOOSE_CHARACTERS = re.compile(r'^(\S+ ::= )\(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.MULTILINE)
_JSON_CHARACTERS = r"(([^\0-\x1f\"\\\r\n]))"


def reason(exc: BaseException) -> str:
    """xgrammar's message without its log prefix (time, source file), on one line."""
    text = str(exc).strip()
    lines = [_LOG_PREFIX.sub("", line).strip() for line in text.splitlines()]
    text = " ".join(line for line in lines if line) or type(exc).__name__
    if len(text) > MAX_REASON_CHARS:
        text = text[:MAX_REASON_CHARS] + " …"
    return text


def constraint_error(what: str, exc: BaseException) -> ConstraintError:
    return ConstraintError(f"Invalid {what}: {reason(exc)}")


def patch_json_strings(ebnf: str) -> str:
    """``ebnf`` with the character rules of length-bounded JSON strings keeping out control
    characters (U+0000 to U+001F), which xgrammar's let through."""
    return _LOOSE_CHARACTERS.sub(lambda m: m.group(1) + _JSON_CHARACTERS, ebnf)


SURROGATES = (0xD800, 0xDFFF)
_NO_SURROGATES = "\\ud800-\\udfff"
_NEGATED_SHORTHANDS = {"D": "\\d", "W": "\\w", "S": "\\s"}


def python_regex(regex: str) -> str:
    """``regex`` as Python's ``re`` reads it (the engine's reference for ``regex``, and
    ``jsonschema``'s for ``pattern``), and never matching a UTF-16 surrogate: xgrammar's
    ``.`` matches a newline and a surrogate, its negated classes (``[^a]``, ``\\D``,
    ``\\W``, ``\\S``) a surrogate, encoded in UTF-8 as Python's ``re`` never sees it. So
    ``.`` becomes ``[^\\n\\ud800-\\udfff]``, each negated class also leaves out the
    surrogates."""
    out: list[str] = []
    i, n = 0, len(regex)
    while i < n:
        c = regex[i]
        if c == "\\":
            shorthand = _NEGATED_SHORTHANDS.get(regex[i + 1 : i + 2])
            out.append(f"[^{shorthand}{_NO_SURROGATES}]" if shorthand else regex[i : i + 2])
            i += 2
        elif c == "[":
            j = i + 1
            negated = j < n and regex[j] == "^"
            if negated:
                j += 1
            if j < n and regex[j] == "]":  # a "]" first in a class is a literal
                j += 1
            while j < n and regex[j] != "]":
                j += 2 if regex[j] == "\\" else 1
            body = regex[i + 1 : j]
            out.append(f"[{body}{_NO_SURROGATES}]" if negated else _positive_class(body))
            i = j + 1
        elif c == ".":
            out.append(f"[^\\n{_NO_SURROGATES}]")
            i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _positive_class(body: str) -> str:
    """The regex class ``[body]`` (not negated), written without the surrogates where it
    holds any (``[\\s\\S]``, ``[\\u0000-\\uffff]``): its members as xgrammar reads them
    (from its printed grammar), less U+D800 to U+DFFF, each as ``\\u{...}``."""
    text = f"[{body}]"
    try:
        printed = str(xgr.Grammar.from_regex(text)).strip()
    except Exception:  # xgrammar's parser reports it when the regex is compiled
        return text
    head, tail = "root ::= ((", "))"
    if not (printed.startswith(head + "[") and printed.endswith("]" + tail)) or "\n" in printed:
        return text  # one character (printed as a string), or not a plain class
    members = printed[len(head) + 1 : -len(tail) - 1]
    try:
        ranges: list[tuple[int, int]] = []
        j = 0
        while j < len(members):
            # the class is not negated: a "^" first is a member (xgrammar prints it unescaped)
            a, j = _class_char(members, j)
            b = a
            if j + 1 < len(members) and members[j] == "-":
                b, j = _class_char(members, j + 1)
            ranges.append((a, b))
    except (IndexError, ValueError):
        return text
    kept = _without_surrogates(False, ranges)
    if kept is None:
        return text
    if not kept:
        raise ConstraintError(f"Invalid regex: the character class {text} holds only UTF-16 surrogates.")
    return "[" + "".join(f"\\u{{{a:x}}}" + ("" if a == b else f"-\\u{{{b:x}}}") for a, b in kept) + "]"


_CLASS_ESCAPES = {"n": 0x0A, "r": 0x0D, "t": 0x09, "f": 0x0C, "v": 0x0B, "b": 0x08, "a": 0x07, "e": 0x1B, "0": 0}
_HEX_DIGITS = {"x": 2, "u": 4, "U": 8}


def _class_char(text: str, i: int) -> tuple[int, int]:
    """The code point of the (possibly escaped) class character at ``text[i]``, and the index after it."""
    if text[i] != "\\":
        return ord(text[i]), i + 1
    letter = text[i + 1]
    digits = _HEX_DIGITS.get(letter)
    if digits:
        return int(text[i + 2 : i + 2 + digits], 16), i + 2 + digits
    return _CLASS_ESCAPES.get(letter, ord(letter)), i + 2


def _emit_class_char(cp: int) -> str:
    if 0x20 <= cp < 0x7F:
        ch = chr(cp)
        return "\\" + ch if ch in '\\]["^-' else ch
    return f"\\u{cp:04x}" if cp <= 0xFFFF else f"\\U{cp:08x}"


def _without_surrogates(negated: bool, ranges: list[tuple[int, int]]) -> list[tuple[int, int]] | None:
    """The ranges of a class that allows no surrogate; None when it already allows none."""
    lo, hi = SURROGATES
    if negated:
        covered = sorted(r for r in ranges if r[1] >= lo and r[0] <= hi)
        start = lo
        for a, b in covered:
            if a > start:
                break
            start = max(start, b + 1)
        return None if start > hi else [*ranges, SURROGATES]
    if not any(b >= lo and a <= hi for a, b in ranges):
        return None
    kept: list[tuple[int, int]] = []
    for a, b in ranges:
        if b < lo or a > hi:
            kept.append((a, b))
            continue
        if a < lo:
            kept.append((a, lo - 1))
        if b > hi:
            kept.append((hi + 1, b))
    return kept


def exclude_surrogates(ebnf: str) -> str:
    """``ebnf`` (GBNF, or xgrammar's printed form) with no character class allowing a UTF-16
    surrogate (U+D800 to U+DFFF): xgrammar matches one as the three bytes of its (invalid)
    UTF-8 encoding. Classes that allow none are left as they are; text this cannot read
    is returned as it is (xgrammar's parser then says what is wrong with it)."""
    try:
        return _exclude_surrogates(ebnf)
    except ConstraintError:
        raise
    except (IndexError, ValueError):
        return ebnf


def _exclude_surrogates(ebnf: str) -> str:
    out: list[str] = []
    i, n = 0, len(ebnf)
    while i < n:
        c = ebnf[i]
        if c == '"':  # a string literal: copied through
            j = i + 1
            while j < n and ebnf[j] != '"':
                j += 2 if ebnf[j] == "\\" else 1
            out.append(ebnf[i : j + 1])
            i = j + 1
            continue
        if c == "#":  # a comment, to the end of its line
            j = ebnf.find("\n", i)
            j = n if j < 0 else j
            out.append(ebnf[i:j])
            i = j
            continue
        if c != "[":
            out.append(c)
            i += 1
            continue
        j = i + 1
        negated = j < n and ebnf[j] == "^"
        if negated:
            j += 1
        ranges: list[tuple[int, int]] = []
        while ebnf[j] != "]":
            a, j = _class_char(ebnf, j)
            b = a
            if j + 1 < n and ebnf[j] == "-" and ebnf[j + 1] != "]":
                b, j = _class_char(ebnf, j + 1)
            ranges.append((a, b))
        end = j + 1
        kept = _without_surrogates(negated, ranges)
        if kept is None:
            out.append(ebnf[i:end])
        elif not kept:
            raise ConstraintError(
                f"Invalid grammar: the character class {ebnf[i:end]} holds only UTF-16 surrogates, which are not "
                "characters."
            )
        else:
            body = "".join(_emit_class_char(a) + ("" if a == b else "-" + _emit_class_char(b)) for a, b in kept)
            out.append(("[^" if negated else "[") + body + "]")
        i = end
    return "".join(out)


def choice_grammar(choices: tuple[str, ...]) -> str:
    """A GBNF grammar of exactly these strings."""
    alternatives = []
    for choice in dict.fromkeys(choices):
        try:
            choice.encode("utf-8")
        except UnicodeEncodeError:
            raise ConstraintError(f"Invalid choice: {choice!r} holds a lone surrogate, which is not UTF-8.") from None
        # a JSON string literal is a GBNF one: \" \\ \n \uXXXX; other characters as they are
        alternatives.append(json.dumps(choice, ensure_ascii=False))
    return "root ::= " + " | ".join(alternatives)


# JSON Schema keywords


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_VALUES = (
    "additionalProperties",
    "unevaluatedProperties",
    "propertyNames",
    "items",
    "additionalItems",
    "unevaluatedItems",
    "contains",
    "not",
    "if",
    "then",
    "else",
)
# keywords xgrammar 0.2.9 accepts and does not enforce
_IGNORED = {
    "not": "'not'",
    "if": "'if' / 'then' / 'else'",
    "then": "'if' / 'then' / 'else'",
    "else": "'if' / 'then' / 'else'",
    "dependentRequired": "'dependentRequired'",
    "dependentSchemas": "'dependentSchemas'",
    "dependencies": "'dependencies'",
    "contains": "'contains'",
    "minContains": "'minContains'",
    "maxContains": "'maxContains'",
}


def _pointer(path: tuple[str, ...]) -> str:
    return "/" + "/".join(p.replace("~", "~0").replace("/", "~1") for p in path) if path else "the root"


def _schema_nodes(schema: Any) -> Iterator[tuple[dict, tuple[str, ...], int]]:
    """Every (sub)schema object in ``schema`` with its path and depth (the root's is 1),
    through the keywords that hold schemas (not through values such as ``const``, ``enum``
    or ``default``)."""
    stack: list[tuple[Any, tuple[str, ...], int]] = [(schema, (), 1)]
    seen: set[int] = set()
    while stack:
        node, path, depth = stack.pop()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        yield node, path, depth
        below = depth + 1
        for key in _SCHEMA_MAPS:
            value = node.get(key)
            if isinstance(value, dict):
                stack.extend((sub, (*path, key, str(name)), below) for name, sub in value.items())
        for key in _SCHEMA_LISTS:
            value = node.get(key)
            if isinstance(value, list):
                stack.extend((sub, (*path, key, str(i)), below) for i, sub in enumerate(value))
        for key in _SCHEMA_VALUES:
            value = node.get(key)
            if isinstance(value, dict):
                stack.append((value, (*path, key), below))
            elif key == "items" and isinstance(value, list):  # draft 4 to 2019-09 tuples
                stack.extend((sub, (*path, key, str(i)), below) for i, sub in enumerate(value))


def check_depth(schema: Any, max_depth: int) -> None:
    """ConstraintError for a schema nested deeper than ``max_depth`` (subschemas within
    subschemas): xgrammar's conversion takes time growing with about the cube of the depth
    (0.1 s at 100 levels, 3 s at 300, 2 minutes at 1000), and cannot be interrupted."""
    for _, path, depth in _schema_nodes(schema):
        if depth > max_depth:
            raise ConstraintError(
                f"Invalid JSON schema: it nests subschemas more than {max_depth} deep (at {_pointer(path)}); the "
                "xgrammar backend compiles at most that depth (max_schema_depth in --structured-output-config)."
            )


def _regex_problem(pattern: Any) -> str | None:
    try:
        xgr.Grammar.from_regex(str(pattern))
    except Exception as exc:  # xgrammar's regex errors are RuntimeErrors
        return reason(exc)
    return None


def unsupported_keywords(schema: Any) -> list[str]:
    """What in ``schema`` xgrammar would not enforce, each as "what (at where)": keywords it
    ignores, ``uniqueItems``, ``multipleOf`` of other than integers, ``allOf`` of several
    schemas, and patterns it cannot parse (lookarounds, backreferences, ...)."""
    problems: list[str] = []
    for node, path, _ in _schema_nodes(schema):
        where = _pointer(path)
        for key, label in _IGNORED.items():
            if key in node and not (key in ("then", "else") and "if" in node):
                problems.append(f"{label} (at {where})")
        if node.get("uniqueItems") is True:
            problems.append(f"'uniqueItems' (at {where})")
        if "multipleOf" in node:
            step = node["multipleOf"]
            if node.get("type") != "integer" or not isinstance(step, int) or isinstance(step, bool):
                problems.append(f"'multipleOf' other than an integer's by an integer (at {where})")
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            problems.append(f"'allOf' of more than one schema (at {where})")
        if isinstance(node.get("pattern"), str) and (problem := _regex_problem(node["pattern"])):
            problems.append(f"the pattern {node['pattern']!r}: {problem} (at {where})")
        if isinstance(node.get("patternProperties"), dict):
            for name in node["patternProperties"]:
                if problem := _regex_problem(name):
                    problems.append(f"the pattern {name!r}: {problem} (at {where}/patternProperties)")
    return list(dict.fromkeys(problems))


def python_patterns(schema: Any) -> Any:
    """A copy of ``schema`` whose ``pattern`` and ``patternProperties`` regexes are written
    for xgrammar as Python reads them (:func:`python_regex`)."""
    schema = copy.deepcopy(schema)
    for node, _, _ in _schema_nodes(schema):
        if isinstance(node.get("pattern"), str):
            node["pattern"] = python_regex(node["pattern"])
        if isinstance(node.get("patternProperties"), dict):
            node["patternProperties"] = {python_regex(k): v for k, v in node["patternProperties"].items()}
    return schema


# structural tags


STRUCTURAL_TAG_FLAGS = ("at_least_one", "stop_after_first")


def structural_tag_format(tag: dict, json_grammar) -> dict:
    """xgrammar's structural tag for ``tag``: the engine's (vLLM's) format
    ``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`` becomes a
    ``triggered_tags`` format whose contents are ``json_grammar(schema)`` (EBNF text), with
    the optional booleans ``at_least_one`` (the output begins with a tag) and
    ``stop_after_first`` (it ends right after the first tag) passed on as they are; one
    already in xgrammar's format (``{"type": "structural_tag", "format": {...}}``) is kept."""
    if "format" in tag and "structures" not in tag:
        return tag
    unknown = sorted(set(tag) - {"type", "structures", "triggers", *STRUCTURAL_TAG_FLAGS})
    if unknown:
        raise ConstraintError(
            f"Invalid structural tag: unknown key {unknown[0]!r} (expected structures, triggers, at_least_one, "
            "stop_after_first)."
        )
    if tag.get("type", "structural_tag") != "structural_tag":
        raise ConstraintError(f"Invalid structural tag: type must be 'structural_tag', got {tag['type']!r}.")
    for flag in STRUCTURAL_TAG_FLAGS:
        if not isinstance(tag.get(flag, False), bool):
            raise ConstraintError(f"Invalid structural tag: {flag!r} must be true or false, got {tag[flag]!r}.")
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise ConstraintError("Invalid structural tag: 'structures' must be a non-empty list.")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise ConstraintError("Invalid structural tag: 'triggers' must be a non-empty list of non-empty strings.")
    tags = []
    for i, structure in enumerate(structures):
        if not isinstance(structure, dict):
            raise ConstraintError(f"Invalid structural tag: structures[{i}] must be an object.")
        missing = [k for k in ("begin", "schema", "end") if k not in structure]
        if missing:
            raise ConstraintError(f"Invalid structural tag: structures[{i}] has no {missing[0]!r}.")
        extra = sorted(set(structure) - {"begin", "schema", "end"})
        if extra:
            raise ConstraintError(f"Invalid structural tag: structures[{i}] has an unknown key {extra[0]!r}.")
        begin, schema, end = structure["begin"], structure["schema"], structure["end"]
        if not isinstance(begin, str) or not begin or not isinstance(end, str):
            raise ConstraintError(
                f"Invalid structural tag: structures[{i}] needs a non-empty string 'begin' and a string 'end'."
            )
        if not isinstance(schema, (dict, bool)):
            raise ConstraintError(f"Invalid structural tag: structures[{i}].schema must be a JSON Schema object.")
        matching = [t for t in triggers if begin.startswith(t)]
        if not matching:
            raise ConstraintError(
                f"Invalid structural tag: the begin {begin!r} of structures[{i}] starts with none of the triggers."
            )
        try:
            content = json_grammar(schema)
        except ConstraintError as exc:
            raise ConstraintError(f"Invalid structural tag: in structures[{i}].schema: {exc}") from None
        tags.append({"type": "tag", "begin": begin, "content": {"type": "grammar", "grammar": content}, "end": end})
    for trigger in triggers:
        if not any(s["begin"].startswith(trigger) for s in structures):
            raise ConstraintError(f"Invalid structural tag: the trigger {trigger!r} begins none of the structures.")
    return {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": list(triggers),
            "tags": tags,
            **{flag: tag[flag] for flag in STRUCTURAL_TAG_FLAGS if flag in tag},
        },
    }


def tag_json_schemas(tag: Any) -> Iterator[Any]:
    """The JSON schemas of the ``json_schema`` contents in a structural tag of xgrammar's
    format (none in one converted by :func:`structural_tag_format`: its contents are
    grammars)."""
    stack = [tag]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if node.get("type") == "json_schema" and "json_schema" in node:
                yield node["json_schema"]
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
