"""The xgrammar structured-output backend: constraints compiled by xgrammar's
GrammarCompiler into grammars whose per-request GrammarMatchers fill the token masks."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import xgrammar as xgr

from engine.interfaces.structured_output import (
    ConstraintError,
    GrammarMatcher,
    StructuredOutputBackend,
    StructuredOutputInit,
)
from engine.sampling_params import StructuredOutputsParams
from engine_xgrammar import grammars

logger = logging.getLogger("engine")

CONFIG_KEYS = ("max_threads", "lenient", "strict_mode", "max_whitespace", "max_schema_depth", "cache_limit_mb")
# xgrammar's own compile cache is off unless asked for: the engine caches compiled constraints
# by key, and with it on xgrammar compiles large grammars about ten times slower (30 000
# choices: 32 s against 3 s)
DEFAULT_CACHE_LIMIT_MB = 0
DEFAULT_MAX_SCHEMA_DEPTH = 128


@dataclass(frozen=True, eq=False)
class CompiledConstraint:
    """A constraint compiled by xgrammar; every request's matcher starts from it."""

    kind: str
    grammar: xgr.CompiledGrammar


class XGrammarMatcher(GrammarMatcher):
    """One request's xgrammar GrammarMatcher.

    xgrammar keeps every accepted token's state, so any number of tokens (EOS included)
    roll back. A token it refuses leaves it where it was.
    """

    __slots__ = ("compiled", "_matcher", "_usable", "_eos", "_accepted")

    def __init__(self, compiled: CompiledConstraint, usable: bytes, eos_token_ids: tuple[int, ...]) -> None:
        self.compiled = compiled
        self._matcher = xgr.GrammarMatcher(compiled.grammar)
        self._usable = usable  # per id: 1 for the tokenizer's text tokens and EOS
        self._eos = eos_token_ids
        self._accepted = 0  # tokens accepted since the start: how far rollback may go

    def _accept(self, token: int) -> bool:
        # xgrammar logs a warning for a special token, or any after its end: those are
        # refused here without asking
        if not 0 <= token < len(self._usable) or not self._usable[token] or self._matcher.is_terminated():
            return False
        if not self._matcher.accept_token(token):
            return False
        self._accepted += 1
        return True

    def accept_tokens(self, tokens: Sequence[int]) -> bool:
        for token in tokens:
            if not self._accept(int(token)):
                return False
        return True

    def validate_tokens(self, tokens: Sequence[int]) -> int:
        count = 0
        for token in tokens:
            if not self._accept(int(token)):
                break
            count += 1
        if count:
            self._matcher.rollback(count)
            self._accepted -= count
        return count

    def rollback(self, num_tokens: int) -> None:
        if num_tokens < 0 or num_tokens > self._accepted:
            raise ValueError(f"cannot roll back {num_tokens} tokens: the matcher has accepted {self._accepted}")
        if num_tokens:
            self._matcher.rollback(num_tokens)
            self._accepted -= num_tokens

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._matcher.is_terminated():
            fill_only_eos(bitmask, row, self._eos)
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def can_terminate(self) -> bool:
        return not self._matcher.is_terminated() and self._matcher.is_completed()

    def reset(self) -> None:
        self._matcher.reset()
        self._accepted = 0


def fill_only_eos(bitmask: torch.Tensor, row: int, eos_token_ids: Sequence[int]) -> None:
    """``bitmask[row]`` allowing the EOS tokens alone (a terminated matcher's row: xgrammar
    has no mask after the end)."""
    bitmask[row].zero_()
    for token in eos_token_ids:
        word, bit = divmod(token, 32)
        value = (int(bitmask[row, word]) & 0xFFFFFFFF) | (1 << bit)
        bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value


class XGrammarBackend(StructuredOutputBackend):
    """Compiles every constraint kind with xgrammar.

    ``--structured-output-config`` keys (the README's table says more): ``max_threads``
    (threads compiling one constraint and filling a batch's masks; the engine's setting),
    ``lenient`` (JSON Schema keywords xgrammar does not enforce are ignored instead of
    refused), ``strict_mode`` (xgrammar's: objects and arrays admit no properties or items
    their schema does not name; default true), ``max_whitespace`` (at most this many
    whitespace characters in a row where JSON whitespace is free; default unbounded),
    ``max_schema_depth`` (deepest nesting of subschemas compiled; default 128) and
    ``cache_limit_mb`` (xgrammar's compile cache; 0, the default: off; -1: unbounded).
    """

    name = "xgrammar"

    def __init__(self, init: StructuredOutputInit) -> None:
        super().__init__(init)
        config = dict(init.config or {})
        unknown = sorted(set(config) - set(CONFIG_KEYS))
        if unknown:
            raise ValueError(
                f"Unknown xgrammar setting {unknown[0]!r} in --structured-output-config; the settings are "
                f"{', '.join(CONFIG_KEYS)}."
            )
        self.lenient = _flag(config, "lenient", False)
        self.strict_mode = _flag(config, "strict_mode", True)
        self.max_whitespace = _count(config, "max_whitespace", None, minimum=1)
        self.max_schema_depth = _count(config, "max_schema_depth", DEFAULT_MAX_SCHEMA_DEPTH, minimum=1)
        cache_limit_mb = _count(config, "cache_limit_mb", DEFAULT_CACHE_LIMIT_MB, minimum=-1)
        self.max_threads = max(1, _count(config, "max_threads", init.max_threads, minimum=1))

        tokenizer = init.tokenizer
        eos = tuple(init.eos_token_ids) or (
            (tokenizer.eos_token_id,) if getattr(tokenizer, "eos_token_id", None) is not None else ()
        )
        eos = tuple(t for t in dict.fromkeys(int(t) for t in eos) if 0 <= t < init.vocab_size)
        if not eos:
            raise ValueError("The xgrammar backend needs the model's EOS token, and it has none within its vocabulary.")
        self.eos_token_ids = eos
        self.tokenizer_info = tokenizer_info(tokenizer, init.vocab_size, eos)
        usable = bytearray(init.vocab_size)
        for token_id in tokenizer.get_vocab().values():
            if 0 <= token_id < init.vocab_size:
                usable[token_id] = 1
        for token_id in self.tokenizer_info.special_token_ids:
            if 0 <= token_id < init.vocab_size:
                usable[token_id] = 0
        for token_id in eos:
            usable[token_id] = 1
        self._usable = bytes(usable)
        self.compiler = xgr.GrammarCompiler(
            self.tokenizer_info,
            max_threads=self.max_threads,
            cache_enabled=cache_limit_mb != 0,
            cache_limit_bytes=-1 if cache_limit_mb < 0 else cache_limit_mb << 20,
        )
        self._batch = xgr.BatchGrammarMatcher(self.max_threads) if self.max_threads > 1 else None

    # compiling

    def compile(self, constraint: StructuredOutputsParams) -> CompiledConstraint:
        kind, spec = constraint.kind, constraint.spec
        if kind == "json":
            compiled = self._compile_ebnf(self.json_grammar(spec, constraint.disable_any_whitespace), "JSON schema")
        elif kind == "json_object":
            schema = {"type": "object"}
            compiled = self._compile_ebnf(self.json_grammar(schema, constraint.disable_any_whitespace), "JSON schema")
        elif kind == "regex":
            try:
                compiled = self.compiler.compile_regex(grammars.python_regex(spec))
            except Exception as exc:
                raise grammars.constraint_error("regex", exc) from None
        elif kind == "choice":
            compiled = self._compile_ebnf(grammars.choice_grammar(spec), "choice")
        elif kind == "grammar":
            compiled = self._compile_ebnf(grammars.exclude_surrogates(spec), "grammar")
        elif kind == "structural_tag":
            tag = grammars.structural_tag_format(
                spec, lambda schema: self.json_grammar(schema, constraint.disable_any_whitespace)
            )
            for schema in grammars.tag_json_schemas(tag):  # of a tag in xgrammar's own format
                try:
                    self._check_schema(schema)
                except ConstraintError as exc:
                    raise ConstraintError(f"Invalid structural tag: in a json_schema content: {exc}") from None
            try:
                text = str(xgr.Grammar.from_structural_tag(tag))
            except Exception as exc:
                raise grammars.constraint_error("structural tag", exc) from None
            compiled = self._compile_ebnf(self._patched(text), "structural tag")
        else:
            raise ConstraintError(f"The xgrammar backend does not support {kind} constraints.")
        return CompiledConstraint(kind, compiled)

    def json_grammar(self, schema: Any, disable_any_whitespace: bool) -> str:
        """The EBNF text of a JSON Schema (xgrammar's conversion, its strings patched);
        ConstraintError for an invalid one or one xgrammar would not enforce."""
        try:
            return self._json_grammar(schema, disable_any_whitespace)
        except RecursionError:
            raise ConstraintError("Invalid JSON schema: it is nested too deeply.") from None

    def _check_schema(self, schema: Any) -> None:
        grammars.check_depth(schema, self.max_schema_depth)
        if not self.lenient:
            problems = grammars.unsupported_keywords(schema)
            if problems:
                raise ConstraintError(
                    "Invalid JSON schema: the xgrammar backend does not enforce "
                    + "; ".join(problems[:5])
                    + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
                    + ' (set "lenient": true in --structured-output-config to ignore what it does not enforce).'
                )

    def _json_grammar(self, schema: Any, disable_any_whitespace: bool) -> str:
        self._check_schema(schema)
        try:
            text = json.dumps(grammars.python_patterns(schema), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ConstraintError(f"Invalid JSON schema: {exc}.") from None
        whitespace = {}
        if disable_any_whitespace:
            whitespace = {"any_whitespace": False, "separators": (",", ":")}
        elif self.max_whitespace is not None:
            whitespace = {"any_whitespace": True, "max_whitespace_cnt": self.max_whitespace}
        try:
            grammar = xgr.Grammar.from_json_schema(text, strict_mode=self.strict_mode, **whitespace)
        except Exception as exc:
            raise grammars.constraint_error("JSON schema", exc) from None
        return self._patched(str(grammar))

    @staticmethod
    def _patched(ebnf: str) -> str:
        """xgrammar's printed grammar with its JSON strings holding no control characters
        and its character classes no surrogates."""
        return grammars.exclude_surrogates(grammars.patch_json_strings(ebnf))

    def _compile_ebnf(self, ebnf: str, what: str) -> xgr.CompiledGrammar:
        try:
            return self.compiler.compile_grammar(ebnf)
        except Exception as exc:
            raise grammars.constraint_error(what, exc) from None

    # matching

    def matcher(self, compiled: CompiledConstraint, max_rollback: int) -> XGrammarMatcher:
        # xgrammar's matchers roll back without limit: max_rollback needs nothing
        return XGrammarMatcher(compiled, self._usable, self.eos_token_ids)

    def fill_bitmask(self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        batch: list[Any] = []
        batch_rows: list[int] = []
        for matcher, row in zip(matchers, rows):
            if isinstance(matcher, XGrammarMatcher) and not matcher.is_terminated():
                batch.append(matcher._matcher)
                batch_rows.append(int(row))
            else:
                matcher.fill_bitmask(bitmask, row)
        if len(batch) == 1 or (batch and self._batch is None):
            for handle, row in zip(batch, batch_rows):
                handle.fill_next_token_bitmask(bitmask, row)
        elif batch:
            self._batch.batch_fill_next_token_bitmask(batch, bitmask, batch_rows)

    def close(self) -> None:
        self.compiler.clear_cache()


def tokenizer_info(tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> xgr.TokenizerInfo:
    """xgrammar's view of the tokenizer, ``vocab_size`` wide, with the EOS tokens as its stop
    tokens. Special tokens (EOS among them) are blanked: xgrammar takes a special token whose
    text it can read ("<s>") for that text, and never allows one it cannot read (an empty
    one) as text; ids past the tokenizer's are empty as well."""
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids))
    special = set(eos_token_ids) | set(getattr(tokenizer, "all_special_ids", ()) or ())
    for token_id, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            special.add(int(token_id))
    vocab = [""] * vocab_size
    for text, token_id in tokenizer.get_vocab().items():
        if 0 <= token_id < vocab_size and token_id not in special:
            vocab[token_id] = text
    return xgr.TokenizerInfo.from_vocab_and_metadata(vocab, info.dump_metadata())


def _flag(config: dict, key: str, default: bool) -> bool:
    value = config.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"The xgrammar setting {key!r} must be true or false, got {value!r}.")
    return value


def _count(config: dict, key: str, default: Any, *, minimum: int) -> Any:
    value = config.get(key, default)
    if value is None and default is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"The xgrammar setting {key!r} must be an integer of at least {minimum}, got {value!r}.")
    return value
