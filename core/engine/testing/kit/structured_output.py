"""``StructuredOutputBackendTests``: a structured-output backend against references that
know nothing of grammars.

The checks walk each constraint at random, token by token, drawing only what the
backend's bitmask allows, and judge the finished text with an independent reference:
``jsonschema`` for JSON Schemas, ``json.loads`` for JSON objects, ``re.fullmatch`` for
regexes (and for GBNF grammars, through a Python regex of the same language), membership
for choices, a scan for a structural tag's segments, each one's JSON judged by
``jsonschema``. Along the way every mask must keep out the tokens the tokenizer does not
have and its special tokens (EOS aside), allow EOS exactly when the matcher says the
output can end, admit only well-formed UTF-8 (RFC 3629) where any character may come,
and come out the same whatever the row held before. A hand-written valid output of each
constraint, in the tokenizer's own tokenization, must pass through the masks whole: a mask
may not bar what the constraint allows. The matcher's bookkeeping (validate, rollback,
reset, refusal of disallowed tokens), the batched fill, the reuse of a compiled
constraint, concurrent compiles and the errors for invalid constraints are checked
against the matcher's own answers at known positions.

The tokenizer is the kit's tiny byte-level BPE one (``make_tiny_tokenizer``): every byte
is a token, so any text has a tokenization, and tokens are mostly short, so walks are
long enough to pass many states. The model's vocabulary is wider than the tokenizer's
(as with padded embeddings); those extra ids must never be allowed.
"""

from __future__ import annotations

import functools
import json
import random
import re
import threading
from typing import Any, Callable, ClassVar, Iterator, Sequence

import pytest

from engine.testing.kit.base import KitTests, capability_skip

TOKENIZER_SIZE = 320  # make_tiny_tokenizer's
VOCAB_SIZE = TOKENIZER_SIZE + 37  # the model's logits width: 37 ids the tokenizer does not have
MAX_ROLLBACK = 16
WALKS = 20  # random walks per constraint
MAX_WALK = 200  # tokens; a walk still going then is dropped unjudged
P_EOS = 0.3  # chance a walk ends as soon as EOS is allowed
P_CLOSE = 0.35  # chance a step draws among the allowed tokens that close something
CLOSERS = frozenset('"}]),!.>')


@functools.lru_cache(maxsize=1)
def _shifts() -> Any:
    import torch

    return torch.arange(32, dtype=torch.int32)


# the tokenizer and what the checks read of it, built once per process


@functools.lru_cache(maxsize=1)
def tokenizer() -> Any:
    from engine.testing.checkpoints import make_tiny_tokenizer

    tok = make_tiny_tokenizer(TOKENIZER_SIZE)
    assert len(tok) == TOKENIZER_SIZE < VOCAB_SIZE
    return tok


def eos_id() -> int:
    return tokenizer().eos_token_id


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    # GPT-2's byte-to-unicode table, reversed: byte-level BPE token text back to bytes
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


@functools.lru_cache(maxsize=1)
def token_bytes() -> tuple[bytes, ...]:
    """Each token's bytes (special tokens: their text)."""
    tok, table = tokenizer(), _byte_decoder()
    special = set(tok.all_special_ids)
    out = []
    for i, piece in enumerate(tok.convert_ids_to_tokens(list(range(TOKENIZER_SIZE)))):
        out.append(piece.encode() if i in special else bytes(table[c] for c in piece))
    return tuple(out)


def bytes_of(tokens: Sequence[int]) -> bytes:
    """The output bytes of ``tokens`` (EOS dropped)."""
    return b"".join(token_bytes()[t] for t in tokens if t != eos_id())


def text_of(tokens: Sequence[int]) -> str:
    """The output text of ``tokens``, decoded as the tokenizer does: bytes that are not
    UTF-8 become U+FFFD, but an encoded surrogate is one character, so that length
    checks still count characters (``test_outputs_are_utf8`` checks for both)."""
    raw = bytes_of(tokens)
    try:
        return raw.decode("utf-8", errors="surrogatepass")
    except UnicodeDecodeError:
        return raw.decode("utf-8", errors="replace")


def encode(text: str) -> list[int]:
    return tokenizer().encode(text, add_special_tokens=False)


@functools.lru_cache(maxsize=1)
def _closer_mask() -> Any:
    import torch

    mask = torch.zeros(VOCAB_SIZE, dtype=torch.bool)
    special = set(tokenizer().all_special_ids)
    for i, raw in enumerate(token_bytes()):
        if i not in special and CLOSERS & set(raw.decode("latin-1")):
            mask[i] = True
    return mask


@functools.lru_cache(maxsize=1)
def _forbidden_mask() -> Any:
    """Ids no mask may allow: past the tokenizer, and special tokens other than EOS."""
    import torch

    mask = torch.zeros(VOCAB_SIZE, dtype=torch.bool)
    mask[TOKENIZER_SIZE:] = True
    for i in tokenizer().all_special_ids:
        if i != eos_id():
            mask[i] = True
    return mask


# bitmasks


def new_bitmask(rows: int = 1, fill: int = 0) -> Any:
    import torch

    from engine.interfaces.structured_output import bitmask_width

    return torch.full((rows, bitmask_width(VOCAB_SIZE)), fill, dtype=torch.int32)


def unpack(row: Any) -> Any:
    """A bitmask row as ``bool[VOCAB_SIZE]`` (the bits past the vocabulary dropped)."""
    return ((row.unsqueeze(-1) >> _shifts()) & 1).reshape(-1)[:VOCAB_SIZE].bool()


def allowed_of(matcher: Any) -> Any:
    """The matcher's next-token mask as ``bool[VOCAB_SIZE]``, checked to be the same when
    the row was all zeros and all ones before."""
    import torch

    clear, full = new_bitmask(1, 0), new_bitmask(1, -1)
    matcher.fill_bitmask(clear, 0)
    matcher.fill_bitmask(full, 0)
    allowed = unpack(clear[0])
    assert torch.equal(allowed, unpack(full[0])), (
        "fill_bitmask left bits of a row pre-filled with -1 set (it must overwrite the whole row)"
    )
    return allowed


def check_mask(allowed: Any, where: str) -> None:
    bad = (allowed & _forbidden_mask()).nonzero().flatten().tolist()
    assert not bad, f"{where}: the mask allows ids the tokenizer does not have or special tokens: {bad}"
    assert bool(allowed.any()), f"{where}: the mask allows nothing (not even EOS)"


def disallowed_token(allowed: Any) -> int:
    """An ordinary token the mask does not allow."""
    candidates = (~allowed & ~_forbidden_mask()).nonzero().flatten().tolist()
    candidates = [t for t in candidates if t != eos_id()]
    assert candidates, "every token is allowed here"
    return candidates[len(candidates) // 2]


# independent references


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def strict_json(text: str) -> Any:
    """``json.loads`` without the NaN / Infinity extensions."""
    return json.loads(text, parse_constant=_no_constant)


def whitespace_outside_strings(text: str) -> bool:
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in " \t\n\r":
            return True
    return False


def schema_check(schema: dict) -> Callable[[str], None]:
    def check(text: str) -> None:
        import jsonschema

        jsonschema.validate(strict_json(text), schema)

    return check


def object_check(text: str) -> None:
    assert isinstance(strict_json(text), dict), f"not a JSON object: {text!r}"


def regex_check(pattern: str) -> Callable[[str], None]:
    compiled = re.compile(pattern)

    def check(text: str) -> None:
        assert compiled.fullmatch(text), f"{text!r} does not match {pattern!r}"

    return check


def choice_check(choices: Sequence[str]) -> Callable[[str], None]:
    def check(text: str) -> None:
        assert text in choices, f"{text!r} is none of {list(choices)!r}"

    return check


def tag_segments(tag: dict, text: str) -> list[tuple[int, int, str]]:
    """The segments of ``text`` under the structural tag ``tag`` (the engine's format), each
    as (start, end, its JSON's text), found by a plain scan: the first trigger in the free
    text starts a segment, which is one structure's ``begin``, a JSON value valid against
    its schema, and its ``end``; the free text resumes after it. AssertionError (or a JSON
    or ``jsonschema`` error) where ``text`` breaks that. The begins of the kit's tags are
    prefix-free, so a segment's structure is the one whose begin is there."""
    import jsonschema

    decoder = json.JSONDecoder(parse_constant=_no_constant)
    segments, pos = [], 0
    while True:
        hits = [i for i in (text.find(t, pos) for t in tag["triggers"]) if i >= 0]
        if not hits:
            return segments
        start = min(hits)
        structures = [s for s in tag["structures"] if text.startswith(s["begin"], start)]
        assert len(structures) == 1, f"the trigger at {start} of {text!r} starts {len(structures)} structures"
        structure = structures[0]
        json_start = start + len(structure["begin"])
        value, json_end = decoder.raw_decode(text, json_start)
        jsonschema.validate(value, structure["schema"])
        assert text.startswith(structure["end"], json_end), (
            f"the segment at {start} of {text!r} has no {structure['end']!r} after its JSON"
        )
        pos = json_end + len(structure["end"])
        segments.append((start, pos, text[json_start:json_end]))


def structural_tag_check(
    tag: dict, *, at_least_one: bool = False, stop_after_first: bool = False, compact: bool = False
) -> Callable[[str], None]:
    """The reference of a structural tag: its segments (:func:`tag_segments`); with
    ``at_least_one`` the text starts with one; with ``stop_after_first`` there is at most
    one and nothing after it (so with both, the text is exactly one segment); with
    ``compact`` (disable_any_whitespace) no segment's JSON has whitespace outside strings."""

    def check(text: str) -> None:
        segments = tag_segments(tag, text)
        if at_least_one:
            assert segments and segments[0][0] == 0, f"{text!r} does not start with a segment"
        if stop_after_first:
            assert len(segments) <= 1, f"{text!r} has {len(segments)} segments"
            assert not segments or segments[0][1] == len(text), f"{text!r} goes on after its first segment"
        if compact:
            loose = [j for _, _, j in segments if whitespace_outside_strings(j)]
            assert not loose, f"whitespace outside strings in the segments' JSON {loose!r}"

    return check


# the constraints walked; each schema's instances are finite, so walks end

SCHEMAS: dict[str, dict] = {
    "nested_object": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "address": {
                "type": "object",
                "properties": {
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                    "city": {"type": "string", "maxLength": 5},
                },
                "required": ["zip", "city"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "age", "address"],
        "additionalProperties": False,
    },
    "bounded_array": {
        "type": "array",
        "items": {"type": "integer", "minimum": -5, "maximum": 5},
        "minItems": 1,
        "maxItems": 4,
    },
    "enum_and_optional": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "L"]},
            "note": {"type": "string", "maxLength": 4},
        },
        "required": ["color"],
        "additionalProperties": False,
    },
    "numbers_and_booleans": {
        "type": "object",
        "properties": {
            "x": {"type": "number", "minimum": -1.5, "maximum": 2.5},
            "n": {"type": "integer", "minimum": 10, "maximum": 99},
            "flag": {"type": "boolean"},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
        },
        "required": ["x", "flag"],
        "additionalProperties": False,
    },
    "array_of_objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 1, "maximum": 99},
                "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]$"},
            },
            "required": ["id", "code"],
            "additionalProperties": False,
        },
        "maxItems": 2,
    },
}

REGEXES = (
    r"[a-z]{2,6}@[a-z]{2,5}\.(com|org|net)",
    r"-?(0|[1-9][0-9]{0,3})(\.[0-9]{1,2})?",
    r"(cat|dog)( and (cat|dog)){0,2}",
)

CHOICES = (("red", "green", "blue", "light blue"), ("yes", "no", "yes please"))

# GBNF grammars and a Python regex of the same language each
GRAMMARS = (
    ('root ::= "(" [0-9]+ ("," [0-9]+)* ")"', r"\([0-9]+(,[0-9]+)*\)"),
    (
        'root ::= greeting " " name "!"\ngreeting ::= "hi" | "hello"\nname ::= [A-Z] [a-z]*\n',
        r"(hi|hello) [A-Z][a-z]*!",
    ),
)


def walk_cases() -> list[Any]:
    cases = [pytest.param({"json": s}, schema_check(s), id=f"json-{name}") for name, s in SCHEMAS.items()]
    cases.append(pytest.param({"json_object": True}, object_check, id="json_object"))
    cases += [pytest.param({"regex": r}, regex_check(r), id=f"regex-{i}") for i, r in enumerate(REGEXES)]
    cases += [pytest.param({"choice": list(c)}, choice_check(c), id=f"choice-{i}") for i, c in enumerate(CHOICES)]
    cases += [pytest.param({"grammar": g}, regex_check(r), id=f"grammar-{i}") for i, (g, r) in enumerate(GRAMMARS)]
    return cases


# an output each walked constraint allows, by case id: written by hand, judged by the same
# reference, and tokenized by the tokenizer, so that merged tokens (" and", "12", "KV") come
# where single bytes could too
VALID_OUTPUTS = {
    "json-nested_object": '{"name": "An 12", "age": 34, "address": {"zip": "90210", "city": "Rome"}}',
    "json-bounded_array": "[1, -5, 0, 5]",
    "json-enum_and_optional": '{"color": "green", "size": "L", "note": "a nd"}',
    "json-numbers_and_booleans": '{"x": -1.25, "n": 12, "flag": true, "tags": ["at", "the"]}',
    "json-array_of_objects": '[{"id": 12, "code": "KV9"}, {"id": 34, "code": "AB1"}]',
    "json_object": '{"he": [12, 3.4, null, false], "the like": {"a": "b and c"}}',
    "regex-0": "ann@mail.com",
    "regex-1": "-1234.5",
    "regex-2": "cat and dog and cat",
    "choice-0": "light blue",
    "choice-1": "yes please",
    "grammar-0": "(12,34,5)",
    "grammar-1": "hello World!",
}


def valid_output_cases() -> list[Any]:
    return [pytest.param(*case.values, VALID_OUTPUTS[case.id], id=case.id) for case in walk_cases()]


def utf8_cases() -> list[Any]:
    strings = {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 3}
    return [
        pytest.param({"json_object": True}, id="json_object"),
        pytest.param({"json": strings}, id="json-strings"),
        pytest.param({"grammar": 'root ::= "(" [^()]+ ")"'}, id="grammar-negated-class"),
    ]


# where any character may come next, and the tokens that lead there
ANY_CHARACTER = (
    pytest.param({"json_object": True}, '{"', id="json_object-key"),
    pytest.param({"json": {"type": "string", "maxLength": 4}}, '"', id="json-string"),
    pytest.param({"grammar": 'root ::= "(" [^()]+ ")"'}, "(", id="grammar-negated-class"),
    pytest.param({"regex": r"\([^()]+\)"}, "(", id="regex-negated-class"),
)

# RFC 3629: the bytes that may start a character, and those that may follow each lead byte
UTF8_LEADS = frozenset(range(0x80)) | frozenset(range(0xC2, 0xF5))
UTF8_SECOND = {0xE0: range(0xA0, 0xC0), 0xED: range(0x80, 0xA0), 0xF0: range(0x90, 0xC0), 0xF4: range(0x80, 0x90)}


def byte_ranges(values: Sequence[int]) -> str:
    """Bytes as hex ranges: "0xa0-0xbf, 0xc0"."""
    runs: list[list[int]] = []
    for b in sorted(values):
        if runs and b == runs[-1][1] + 1:
            runs[-1][1] = b
        else:
            runs.append([b, b])
    return ", ".join(f"{lo:#04x}" if lo == hi else f"{lo:#04x}-{hi:#04x}" for lo, hi in runs) or "nothing"


def no_whitespace_cases() -> list[Any]:
    cases = [pytest.param(s, id=name) for name, s in SCHEMAS.items()]
    cases.append(pytest.param(None, id="json_object"))
    return cases


WEATHER_TAG = {
    "structures": [
        {
            "begin": "<tool=get_weather>",
            "schema": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 8}},
                "required": ["city"],
                "additionalProperties": False,
            },
            "end": "</tool>",
        }
    ],
    "triggers": ["<tool="],
}

# two triggers, one of them starting two structures; the begins are prefix-free
TOOLS_TAG = {
    "structures": [
        WEATHER_TAG["structures"][0],
        {
            "begin": "<tool=get_time>",
            "schema": {
                "type": "object",
                "properties": {"zone": {"enum": ["UTC", "CET"]}},
                "required": ["zone"],
                "additionalProperties": False,
            },
            "end": "</tool>",
        },
        {"begin": "[[note:", "schema": {"type": "string", "maxLength": 4}, "end": "]]"},
    ],
    "triggers": ["<tool=", "[["],
}

# the keys that force a segment, whether JSON is compact (disable_any_whitespace), and the
# texts walks start from: nothing where the output must begin with a segment; where free
# text may come first, free text and each trigger, so that walks enter segments too
FORCING_TAGS = (
    pytest.param({"at_least_one": True}, False, ("",), id="at_least_one"),
    pytest.param({"stop_after_first": True}, False, ("Hi", "Hi <tool=", "[["), id="stop_after_first"),
    pytest.param({"at_least_one": True, "stop_after_first": True}, False, ("",), id="at_least_one-stop_after_first"),
    pytest.param({"at_least_one": True}, True, ("",), id="at_least_one-compact"),
)

INVALID = (
    pytest.param({"json": {"type": "nonsense"}}, id="json-unknown-type"),
    pytest.param({"json": {"type": 12}}, id="json-type-not-a-string"),
    pytest.param({"json": {"type": "object", "properties": {"a": 5}}}, id="json-property-not-a-schema"),
    pytest.param({"regex": "([a-z]"}, id="regex-unbalanced"),
    pytest.param({"grammar": 'root ::= ("a" | "b"'}, id="grammar-unbalanced"),
    pytest.param({"grammar": 'root ::= "a" undefined_rule'}, id="grammar-undefined-rule"),
    pytest.param(
        {
            "structural_tag": {
                "structures": [{"begin": "<a>", "schema": {"type": "nonsense"}, "end": "</a>"}],
                "triggers": ["<a"],
            }
        },
        id="structural_tag-invalid-schema",
    ),
)


class StructuredOutputBackendTests(KitTests):
    """Subclass with ``plugin`` and ``backend_name``; override :meth:`config` for the
    backend's ``--structured-output-config``. Checks of constraint kinds missing from the
    backend's ``supported_kinds`` are skipped."""

    registry_name = "structured_output_backends"
    backend_name: ClassVar[str | None] = None

    def config(self) -> dict[str, Any]:
        return {}

    # helpers

    def backend_class(self) -> Any:
        return self.resolve(self.required("backend_name"))

    @pytest.fixture(scope="class")
    @classmethod
    def backend(cls) -> Iterator[Any]:
        """One backend for the class's checks (building one reads the whole vocabulary)."""
        from engine.interfaces.structured_output import StructuredOutputInit

        kit, tok = cls(), tokenizer()
        init = StructuredOutputInit(
            tokenizer=tok, vocab_size=VOCAB_SIZE, eos_token_ids=(tok.eos_token_id,), config=kit.config(), max_threads=2
        )
        backend = kit.backend_class()(init)
        yield backend
        backend.close()

    def constraint(self, backend: Any, **kwargs: Any) -> Any:
        """The StructuredOutputsParams, after skipping when the backend lacks its kind."""
        from engine.sampling_params import StructuredOutputsParams

        params = StructuredOutputsParams(**kwargs)
        if params.kind not in backend.supported_kinds:
            capability_skip(f"{params.kind} constraints")
        return params

    def compile(self, backend: Any, **kwargs: Any) -> Any:
        return backend.compile(self.constraint(backend, **kwargs))

    def matcher(self, backend: Any, compiled: Any) -> Any:
        return backend.matcher(compiled, MAX_ROLLBACK)

    def walk(self, backend: Any, compiled: Any, seed: int, prefix: Sequence[int] = ()) -> list[int] | None:
        """One random walk to EOS (its tokens, EOS last), checking every mask on the way;
        None when it did not end within ``MAX_WALK`` tokens. The walk starts with the tokens
        of ``prefix``, each of which must be allowed."""
        import torch

        rng = random.Random(seed)
        gen = torch.Generator().manual_seed(seed)
        m = self.matcher(backend, compiled)
        eos, tokens = eos_id(), []
        for token in prefix:
            allowed = allowed_of(m)
            check_mask(allowed, f"walk {seed}, after {text_of(tokens)!r}")
            assert bool(allowed[token]) and m.accept_tokens([token]), (
                f"walk {seed}: the token {token} of its prefix is refused after {text_of(tokens)!r}"
            )
            tokens.append(token)
        for step in range(MAX_WALK):
            where = f"walk {seed}, after {text_of(tokens)!r}"
            allowed = allowed_of(m)
            check_mask(allowed, where)
            eos_allowed = bool(allowed[eos])
            assert m.can_terminate() == eos_allowed, (
                f"{where}: can_terminate() is {m.can_terminate()} but the mask {'allows' if eos_allowed else 'bars'} EOS"
            )
            if step == 0 and not prefix:
                assert not eos_allowed, "EOS is allowed before any output (the constraint's language has no empty text)"
            others = allowed.clone()
            others[eos] = False
            if eos_allowed and (rng.random() < P_EOS or not bool(others.any())):
                token = eos
            else:
                pool = others & _closer_mask() if rng.random() < P_CLOSE else others
                if not bool(pool.any()):
                    pool = others
                ids = pool.nonzero().flatten()
                token = int(ids[torch.randint(len(ids), (1,), generator=gen)])
            assert m.accept_tokens([token]) is True, f"{where}: accept_tokens refused the allowed token {token}"
            tokens.append(token)
            if token == eos:
                assert m.is_terminated(), f"{where}: is_terminated() is False after EOS was accepted"
                return tokens
            assert not m.is_terminated(), f"{where}: is_terminated() is True before EOS"
        return None

    def run_walks(
        self, backend: Any, compiled: Any, check: Callable[[str], None], *, seed: int = 0, prefix: Sequence[int] = ()
    ) -> list[str]:
        """The texts of ``WALKS`` random walks (from ``prefix``), each checked by the reference."""
        texts = []
        for i in range(WALKS):
            tokens = self.walk(backend, compiled, seed * 1000 + i, prefix)
            if tokens is None:
                continue
            text = text_of(tokens)
            try:
                check(text)
            except Exception as exc:
                raise AssertionError(
                    f"walk {seed * 1000 + i} produced {text!r}, which the reference refuses: {exc}"
                ) from None
            texts.append(text)
        assert len(texts) >= WALKS // 4, f"only {len(texts)} of {WALKS} random walks ended within {MAX_WALK} tokens"
        return texts

    def complete_walk(self, backend: Any, compiled: Any, min_tokens: int) -> list[int]:
        """A random walk to EOS with at least ``min_tokens`` tokens before EOS."""
        for seed in range(100):
            tokens = self.walk(backend, compiled, 7000 + seed)
            if tokens is not None and len(tokens) > min_tokens:
                return tokens
        raise AssertionError(f"no random walk of at least {min_tokens} tokens ended")

    def mask_after(self, backend: Any, compiled: Any, tokens: Sequence[int]) -> Any:
        m = self.matcher(backend, compiled)
        assert m.accept_tokens(list(tokens))
        return allowed_of(m)

    # checks

    def test_discoverable(self) -> None:
        """The plugin registers the backend under its declared name (or ``backend_name`` is its
        ``module.path:Class``), as an engine backend."""
        from engine.interfaces.structured_output import StructuredOutputBackend
        from engine.plugins.manager import get_plugin_manager

        name = self.required("backend_name")
        cls = (
            get_plugin_manager([self.required("plugin"), *self.also_load])
            .components()
            .structured_output_backends.get(name)
        )
        assert isinstance(cls, type) and issubclass(cls, StructuredOutputBackend), cls
        self.assert_named(cls, name)

    @pytest.mark.parametrize(("spec", "check"), walk_cases())
    def test_random_walks_satisfy_the_reference(self, backend: Any, spec: dict, check: Callable[[str], None]) -> None:
        """Random walks through the masks end (EOS accepted, the matcher terminated) in text
        the independent reference accepts; every mask on the way is well-formed."""
        compiled = self.compile(backend, **spec)
        texts = self.run_walks(backend, compiled, check)
        if "choice" in spec:
            assert len(set(texts)) > 1, f"every walk gave {texts[0]!r}"

    @pytest.mark.parametrize(("spec", "check", "text"), valid_output_cases())
    def test_valid_outputs_are_allowed(self, backend: Any, spec: dict, check: Callable[[str], None], text: str) -> None:
        """An output the reference accepts, in the tokenizer's own tokenization (merged tokens
        such as " and" or "12", not single bytes only), is allowed token by token and may end
        there: a mask must not bar what the constraint allows."""
        check(text)  # the kit's example is valid by the reference
        m, tokens = self.matcher(backend, self.compile(backend, **spec)), encode(text)
        for i, token in enumerate(tokens):
            where = f"after {text_of(tokens[:i])!r} of the valid output {text!r}"
            assert bool(allowed_of(m)[token]), (
                f"{where}: the mask bars its next token {token_bytes()[token]!r} ({token})"
            )
            assert m.accept_tokens([token]), f"{where}: accept_tokens refused its next token {token_bytes()[token]!r}"
        allowed = allowed_of(m)
        check_mask(allowed, f"after the valid output {text!r}")
        assert m.can_terminate() and bool(allowed[eos_id()]), f"the valid output {text!r} may not end"
        assert m.accept_tokens([eos_id()]) and m.is_terminated()

    @pytest.mark.parametrize(
        ("spec", "prefix"),
        [
            pytest.param({"grammar": 'root ::= "<" [a-z/]+ ">"'}, "<ab", id="grammar"),
            pytest.param({"regex": "<[a-z/]+>"}, "<ab", id="regex"),
            pytest.param({"json": {"type": "string", "maxLength": 8}}, '"ab', id="json-string"),
        ],
    )
    def test_special_tokens_are_not_text(self, backend: Any, spec: dict, prefix: str) -> None:
        """Special tokens never stand for their text: where "<s>", "</s>" or "<unk>" would fit
        as characters, those tokens (EOS too) stay barred until the output may end."""
        compiled = self.compile(backend, **spec)
        m, tokens = self.matcher(backend, compiled), encode(prefix)
        for k in range(len(tokens) + 1):
            assert k == 0 or m.accept_tokens([tokens[k - 1]])
            allowed = allowed_of(m)
            special = [t for t in tokenizer().all_special_ids if bool(allowed[t])]
            assert not special, f"after {text_of(tokens[:k])!r}, special tokens are allowed as text: {special}"
            assert not m.can_terminate()

    @pytest.mark.parametrize(("spec", "prefix"), ANY_CHARACTER)
    def test_utf8_sequences_are_well_formed(self, backend: Any, spec: dict, prefix: str) -> None:
        """Where any character may come, the mask admits exactly the well-formed UTF-8
        starts (RFC 3629): no continuation byte or C0, C1, F5-FF as a first byte, and after
        each lead byte only the second bytes it may take (no surrogates after ED, no
        overlong forms after E0 / F0, nothing past U+10FFFF after F4)."""
        compiled = self.compile(backend, **spec)
        eos, start = eos_id(), encode(prefix)

        def first_bytes(allowed: Any) -> set[int]:
            return {token_bytes()[t][0] for t in allowed.nonzero().flatten().tolist() if t != eos}

        leads = first_bytes(self.mask_after(backend, compiled, start))
        assert leads & set(range(0xC2, 0xF5)), f"after {prefix!r}, no character beyond ASCII may start"
        bad = sorted(leads - UTF8_LEADS)
        assert not bad, f"after {prefix!r}, tokens starting with these bytes are allowed: {byte_ranges(bad)}"
        byte_token = {raw[0]: i for i, raw in enumerate(token_bytes()) if len(raw) == 1}
        wrong = {}
        for lead in sorted(leads - set(range(0x80))):
            seconds = first_bytes(self.mask_after(backend, compiled, [*start, byte_token[lead]]))
            allowed_seconds = set(UTF8_SECOND.get(lead, range(0x80, 0xC0)))
            if not seconds or not seconds <= allowed_seconds:
                wrong[f"{lead:#04x}"] = byte_ranges(seconds - allowed_seconds if seconds else [])
        assert not wrong, f"after {prefix!r} and a lead byte, the mask allows these next bytes: {wrong}"

    @pytest.mark.parametrize("spec", utf8_cases())
    def test_outputs_are_utf8(self, backend: Any, spec: dict) -> None:
        """Where any character may come (JSON strings, a negated character class), walks
        still end in valid UTF-8: no surrogates, overlong forms or broken sequences."""
        compiled = self.compile(backend, **spec)
        bad = []
        for i in range(WALKS):
            tokens = self.walk(backend, compiled, 3000 + i)
            if tokens is not None:
                raw = bytes_of(tokens)
                try:
                    raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    try:
                        raw.decode("utf-8", errors="surrogatepass")
                        why = "encoded surrogates"
                    except UnicodeDecodeError:
                        why = exc.reason
                    bad.append(f"{raw!r} ({why}, at byte {exc.start})")
        assert not bad, "outputs that are not UTF-8: " + "; ".join(bad[:3])

    @pytest.mark.parametrize("schema", no_whitespace_cases())
    def test_disable_any_whitespace(self, backend: Any, schema: dict | None) -> None:
        """With disable_any_whitespace, JSON has no whitespace outside its strings."""
        if schema is None:
            compiled = self.compile(backend, json_object=True, disable_any_whitespace=True)
            reference = object_check
        else:
            compiled = self.compile(backend, json=schema, disable_any_whitespace=True)
            reference = schema_check(schema)

        def check(text: str) -> None:
            reference(text)
            assert not whitespace_outside_strings(text), f"whitespace outside strings in {text!r}"

        self.run_walks(backend, compiled, check, seed=1)

    def test_whitespace_is_free_by_default(self, backend: Any) -> None:
        """Without disable_any_whitespace, JSON whitespace may come between tokens; with it, not."""
        space = encode(" ")
        assert len(space) == 1
        free = self.mask_after(backend, self.compile(backend, json_object=True), encode("{"))
        assert bool(free[space[0]]), "a space after '{' is refused although whitespace is free"
        tight = self.mask_after(
            backend, self.compile(backend, json_object=True, disable_any_whitespace=True), encode("{")
        )
        assert not bool(tight[space[0]]), "a space after '{' is allowed with disable_any_whitespace"

    def test_only_eos_once_output_must_end(self, backend: Any) -> None:
        """A complete output that nothing may extend allows EOS and nothing else; one that
        may go on allows EOS and more."""
        eos = eos_id()
        compiled = self.compile(backend, choice=["yes", "no", "yes please"])
        for text, only_eos in (("no", True), ("yes", False), ("yes please", True)):
            allowed = self.mask_after(backend, compiled, encode(text))
            assert bool(allowed[eos]), f"EOS is refused after the choice {text!r}"
            rest = allowed.clone()
            rest[eos] = False
            assert bool(rest.any()) != only_eos, (
                f"after {text!r}: {'tokens besides EOS are allowed' if only_eos else 'only EOS is allowed'}"
            )
        allowed = self.mask_after(backend, self.compile(backend, regex="[a-z]{3}"), encode("abc"))
        assert allowed.nonzero().flatten().tolist() == [eos]

    def test_structural_tag(self, backend: Any) -> None:
        """Free text, then a tagged segment whose JSON follows the structure's schema; the
        output may end outside a segment only; a JSON that breaks the schema is refused."""
        compiled = self.compile(backend, structural_tag=WEATHER_TAG)
        m = self.matcher(backend, compiled)
        full = 'hello <tool=get_weather>{"city": "Paris"}</tool> bye'
        # the output may not end from the trigger's end to the segment's end
        begin, end = full.index("<tool=") + len("<tool="), full.index("</tool>") + len("</tool>")
        tokens: list[int] = []
        for piece in ("hello ", '<tool=get_weather>{"city": "Paris"}</tool>', " bye"):
            for token in encode(piece):
                assert m.accept_tokens([token]), f"token {token} refused after {text_of(tokens)!r}"
                tokens.append(token)
                text = text_of(tokens)
                assert full.startswith(text)
                inside = begin <= len(text) < end
                assert m.can_terminate() != inside, (
                    f"after {text!r}: can_terminate() is {m.can_terminate()} "
                    f"({'inside' if inside else 'outside'} a tagged segment)"
                )
            allowed = allowed_of(m)
            check_mask(allowed, f"after {text_of(tokens)!r}")
            assert bool(allowed[eos_id()]) == m.can_terminate()
        assert m.accept_tokens([eos_id()]) and m.is_terminated()

        m = self.matcher(backend, compiled)
        assert m.accept_tokens(encode("hello ") + encode("<tool=get_weather>"))
        wrong = encode('{"town"')
        valid = max(k for k in range(len(wrong) + 1) if '{"city"'.startswith(text_of(wrong[:k])))
        assert m.validate_tokens(wrong) == valid < len(wrong), (
            f"validate_tokens of '{{\"town\"' inside the segment gave {m.validate_tokens(wrong)}, expected {valid}"
        )

    @pytest.mark.parametrize(("keys", "compact", "prefixes"), FORCING_TAGS)
    def test_structural_tag_forcing_walks(
        self, backend: Any, keys: dict, compact: bool, prefixes: tuple[str, ...]
    ) -> None:
        """Random walks through a structural tag with ``at_least_one`` and / or
        ``stop_after_first`` end in text the reference accepts: every segment's JSON follows
        its structure's schema; with at_least_one the text starts with a segment, with
        stop_after_first it has at most one and nothing after it (exactly one when a trigger
        was written); with disable_any_whitespace the segments' JSON is compact."""
        compiled = self.compile(backend, structural_tag={**TOOLS_TAG, **keys}, disable_any_whitespace=compact)
        check = structural_tag_check(TOOLS_TAG, compact=compact, **keys)
        for seed, prefix in enumerate(prefixes, start=50):
            texts = self.run_walks(backend, compiled, check, seed=seed, prefix=encode(prefix))
            if any(t in prefix for t in TOOLS_TAG["triggers"]):
                counts = {len(tag_segments(TOOLS_TAG, text)) for text in texts}
                assert counts == {1}, f"walks from {prefix!r} have {counts} segments"
            if keys.get("at_least_one"):
                firsts = {s["begin"] for s in TOOLS_TAG["structures"] for text in texts if text.startswith(s["begin"])}
                assert len(firsts) > 1, f"every walk began with {firsts}"

    def test_structural_tag_forcing(self, backend: Any) -> None:
        """at_least_one: nothing but a begin (no text, no EOS) at the start; after the first
        segment, free text and segments (alone) or only EOS (with stop_after_first).
        stop_after_first alone: the empty output and free text may end; after the first
        segment only EOS may come."""
        eos, segment = eos_id(), '<tool=get_time>{"zone": "UTC"}</tool>'
        begins = [s["begin"].encode() for s in TOOLS_TAG["structures"]]
        for keys in ({"at_least_one": True}, {"at_least_one": True, "stop_after_first": True}):
            compiled = self.compile(backend, structural_tag={**TOOLS_TAG, **keys})
            m = self.matcher(backend, compiled)
            start = allowed_of(m)
            check_mask(start, f"{keys}, at the start")
            assert not bool(start[eos]), f"{keys}: EOS is allowed before any segment"
            wrong = [
                token_bytes()[t]
                for t in start.nonzero().flatten().tolist()
                if not any(b.startswith(token_bytes()[t]) or token_bytes()[t].startswith(b) for b in begins)
            ]
            assert not wrong, f"{keys}: tokens that begin no structure are allowed at the start: {wrong[:5]}"
            assert m.accept_tokens(encode(segment)) and m.can_terminate()
            after = allowed_of(m)
            check_mask(after, f"{keys}, after {segment!r}")
            if keys.get("stop_after_first"):
                assert after.nonzero().flatten().tolist() == [eos], f"{keys}: more may follow the first segment"
            else:
                wrong = encode(" then [[nope")
                assert m.validate_tokens(wrong) < len(wrong), f"{keys}: a trigger after the first segment is text"
                assert m.accept_tokens(encode(' then [[note:"ab"]] and <tool=get_time>{"zone": "CET"}</tool>.'))
                assert m.can_terminate(), f"{keys}: free text with segments after the first cannot end"

        m = self.matcher(backend, self.compile(backend, structural_tag={**TOOLS_TAG, "stop_after_first": True}))
        assert m.can_terminate() and bool(allowed_of(m)[eos]), "stop_after_first: the empty output may not end"
        assert m.accept_tokens(encode("Hi there")) and m.can_terminate(), "stop_after_first: free text may not end"
        assert m.accept_tokens(encode(" " + segment)) and m.can_terminate()
        assert allowed_of(m).nonzero().flatten().tolist() == [eos], (
            "stop_after_first: more may follow the first segment"
        )

    def test_validate_rollback_and_reset(self, backend: Any) -> None:
        """validate_tokens counts the allowed leading tokens without moving; rollback and
        reset return to earlier masks exactly, EOS included."""
        import torch

        compiled = self.compile(backend, json=SCHEMAS["nested_object"])
        seq = self.complete_walk(backend, compiled, min_tokens=8)
        m = self.matcher(backend, compiled)
        start = allowed_of(m)
        assert m.validate_tokens(seq) == len(seq), "a valid output (EOS included) is not validated whole"
        assert m.validate_tokens(seq[:-1]) == len(seq) - 1
        assert torch.equal(allowed_of(m), start), "validate_tokens moved the matcher"
        for k in (0, 3):
            bad = disallowed_token(self.mask_after(backend, compiled, seq[:k]))
            assert m.validate_tokens([*seq[:k], bad, *seq[k + 1 :]]) == k, (
                f"an invalid token at {k} is not counted at {k}"
            )
        assert torch.equal(allowed_of(m), start) and not m.is_terminated()

        assert m.accept_tokens(seq[:5])
        m.rollback(3)
        assert torch.equal(allowed_of(m), self.mask_after(backend, compiled, seq[:2])), (
            "after accepting 5 tokens and rolling back 3, the mask differs from that after 2"
        )
        assert m.accept_tokens(seq[2:]) and m.is_terminated(), "the output no longer completes after a rollback"
        m.rollback(1)
        assert not m.is_terminated() and m.can_terminate(), "rolling back EOS does not reopen the output"
        assert torch.equal(allowed_of(m), self.mask_after(backend, compiled, seq[:-1]))
        m.reset()
        assert torch.equal(allowed_of(m), start) and not m.is_terminated(), "reset() is not back at the start"
        assert m.accept_tokens(seq) and m.is_terminated()

    def test_disallowed_token_is_refused(self, backend: Any) -> None:
        """accept_tokens of a token the mask bars returns False and leaves the matcher after
        the tokens before it."""
        import torch

        compiled = self.compile(backend, json=SCHEMAS["nested_object"])
        seq = self.complete_walk(backend, compiled, min_tokens=4)
        m = self.matcher(backend, compiled)
        start = allowed_of(m)
        assert m.accept_tokens([disallowed_token(start)]) is False
        assert m.accept_tokens([eos_id()]) is False, "EOS is accepted before any output"
        assert torch.equal(allowed_of(m), start), "a refused token moved the matcher"
        after2 = self.mask_after(backend, compiled, seq[:2])
        assert m.accept_tokens([*seq[:2], disallowed_token(after2), *seq[3:]]) is False
        assert torch.equal(allowed_of(m), after2), "after a refused third token the matcher is not after the first two"
        assert m.accept_tokens(seq[2:]) and m.is_terminated()

    def test_batched_fill_matches_single_fills(self, backend: Any) -> None:
        """The backend's fill_bitmask writes each matcher's row as its own fill does and no other."""
        import torch

        from engine.sampling_params import StructuredOutputsParams

        nested = self.compile(backend, json=SCHEMAS["nested_object"])
        seq = self.complete_walk(backend, nested, min_tokens=6)
        pool = [(nested, seq[:3]), (nested, seq[:6]), (nested, [])]
        others = (
            ({"regex": REGEXES[0]}, "ab@c"),
            ({"choice": list(CHOICES[0])}, "li"),
            ({"json_object": True}, '{"a": ['),
        )
        for spec, text in others:
            params = StructuredOutputsParams(**spec)
            if params.kind in backend.supported_kinds:
                pool.append((backend.compile(params), encode(text)))
        matchers = []
        for compiled, tokens in pool:
            m = self.matcher(backend, compiled)
            assert m.accept_tokens(tokens)
            matchers.append(m)
        rows = [2 * i + 1 for i in range(len(matchers))][::-1]
        gen = torch.Generator().manual_seed(0)
        before = new_bitmask(2 * len(matchers) + 2)
        before.copy_(torch.randint(-(2**31), 2**31 - 1, before.shape, generator=gen, dtype=torch.int32))
        bitmask = before.clone()
        backend.fill_bitmask(matchers, bitmask, rows)
        for m, row in zip(matchers, rows):
            assert torch.equal(unpack(bitmask[row]), allowed_of(m)), f"row {row} differs from its matcher's own fill"
        for row in set(range(bitmask.shape[0])) - set(rows):
            assert torch.equal(bitmask[row], before[row]), f"row {row}, which no matcher owns, was written"

    @pytest.mark.parametrize("spec", INVALID)
    def test_invalid_constraint_is_refused(self, backend: Any, spec: dict) -> None:
        """An invalid schema, regex or grammar raises ConstraintError (a ValueError) naming it."""
        import jsonschema

        from engine.interfaces.structured_output import ConstraintError

        # the kit's own cases are invalid by the references
        if "json" in spec:
            with pytest.raises(jsonschema.SchemaError):
                jsonschema.Draft202012Validator.check_schema(spec["json"])
        if "regex" in spec:
            with pytest.raises(re.error):
                re.compile(spec["regex"])
        params = self.constraint(backend, **spec)
        with pytest.raises(ConstraintError) as info:
            backend.compile(params)
        assert isinstance(info.value, ValueError) and str(info.value).strip(), "ConstraintError without a message"

    def test_compiled_constraint_is_reusable(self, backend: Any) -> None:
        """Matchers made from one compiled constraint move independently."""
        import torch

        compiled = self.compile(backend, json=SCHEMAS["nested_object"])
        seq = self.complete_walk(backend, compiled, min_tokens=6)
        first, second = self.matcher(backend, compiled), self.matcher(backend, compiled)
        start = allowed_of(first)
        assert first.accept_tokens(seq[:4])
        assert torch.equal(allowed_of(second), start), "advancing one matcher moved another of the same compile"
        after4 = allowed_of(first)
        assert second.accept_tokens(seq[:2])
        assert torch.equal(allowed_of(first), after4)
        assert second.accept_tokens(seq[2:]) and second.is_terminated()
        assert not first.is_terminated() and first.accept_tokens(seq[4:]) and first.is_terminated()

    def test_concurrent_compiles(self, backend: Any) -> None:
        """Compiles of different constraints from 4 threads at once all succeed, and give
        what a compile alone gives."""
        import torch

        from engine.sampling_params import StructuredOutputsParams

        specs = [
            {"json": SCHEMAS["numbers_and_booleans"]},
            {"regex": REGEXES[2]},
            {"grammar": GRAMMARS[0][0]},
            {"choice": list(CHOICES[0])},
            {"json": SCHEMAS["array_of_objects"]},
            {"json": SCHEMAS["enum_and_optional"]},
            {"json_object": True},
            {"regex": REGEXES[0]},
        ]
        params = [p for p in (StructuredOutputsParams(**s) for s in specs) if p.kind in backend.supported_kinds][:4]
        if len(params) < 2:
            capability_skip("two constraint kinds")
        barrier = threading.Barrier(len(params))
        results: list[Any] = [None] * len(params)

        def work(i: int) -> None:
            barrier.wait()
            try:
                results[i] = ("ok", backend.compile(params[i]))
            except BaseException as exc:  # reported below
                results[i] = ("error", exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(params))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        failed = {params[i].kind: r for i, r in enumerate(results) if r is None or r[0] != "ok"}
        assert not failed, f"concurrent compiles failed: {failed}"
        for p, (_, compiled) in zip(params, results):
            alone = backend.compile(p)
            assert torch.equal(allowed_of(self.matcher(backend, compiled)), allowed_of(self.matcher(backend, alone)))
