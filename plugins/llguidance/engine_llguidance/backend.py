"""The llguidance structured-output backend: constraints compiled into llguidance
matchers, one per request, whose token masks the engine applies to the logits."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from engine.interfaces.structured_output import (
    ConstraintError,
    GrammarMatcher,
    StructuredOutputBackend,
    StructuredOutputInit,
    bitmask_width,
)
from engine.sampling_params import StructuredOutputsParams
from engine_llguidance import grammars

logger = logging.getLogger("engine")

# the LLParserLimits fields --structured-output-config may set under "limits"
LIMIT_KEYS = (
    "max_items_in_row",
    "initial_lexer_fuel",
    "step_lexer_fuel",
    "step_max_items",
    "max_lexer_states",
    "max_grammar_size",
    "precompute_large_lexemes",
    "verbose_errors",
)
CONFIG_KEYS = ("max_threads", "lenient", "limits")

# llguidance's grammar compiler recurses once per level of rule references: a chain of a few
# thousand rules overflows a thread's default 8 MiB stack and kills the process. Compiles
# run on a thread of their own with this much stack (address space: pages are only
# committed as they are touched)
COMPILE_STACK_BYTES = 512 << 20
_stack_lock = threading.Lock()

MAX_MESSAGE_CHARS = 2000  # of llguidance's message quoted in a ConstraintError


@dataclass(frozen=True, eq=False)
class CompiledConstraint:
    """A compiled constraint: the llguidance grammar and a matcher at its start, which every
    request's matcher is copied from (a copy shares the compiled grammar and lexer)."""

    kind: str
    grammar: str
    prototype: llguidance.LLMatcher
    warnings: tuple[str, ...] = ()


class LLGuidanceMatcher(GrammarMatcher):
    """One request's llguidance matcher.

    llguidance keeps every consumed token, so any number of them can be rolled back. A
    matcher whose grammar cannot go on (llguidance's "stopped") allows only EOS but does
    not consume it: that EOS is recorded here, and ends the constraint all the same.
    """

    def __init__(self, backend: LLGuidanceBackend, compiled: CompiledConstraint, max_rollback: int) -> None:
        self._backend = backend
        self._compiled = compiled
        self.max_rollback = max_rollback
        self._matcher = compiled.prototype.deep_copy()
        self._accepted = 0  # tokens accepted since the start (EOS included)
        self._terminated = False
        self._eos_kept = False  # the EOS that terminated it was recorded here, not consumed by llguidance

    @property
    def compiled(self) -> CompiledConstraint:
        return self._compiled

    def accept_tokens(self, tokens: Sequence[int]) -> bool:
        backend, matcher = self._backend, self._matcher
        tokens = list(tokens)
        i = 0
        while i < len(tokens):
            if self._terminated or matcher.is_error():
                return False
            token = tokens[i]
            if token in backend.eos_token_set:
                if matcher.is_stopped():
                    self._eos_kept = True  # the grammar is complete and cannot go on
                elif matcher.try_consume_tokens([backend.primary_eos]) != 1:
                    return False
                self._terminated = True
                self._accepted += 1
                i += 1
                continue
            end = i
            while end < len(tokens) and tokens[end] not in backend.eos_token_set:
                end += 1
            run = tokens[i:end]
            allowed = backend.allowed_prefix(run)
            consumed = matcher.try_consume_tokens(run[:allowed]) if allowed else 0
            self._accepted += consumed
            if consumed < len(run):
                return False
            i = end
        return True

    def validate_tokens(self, tokens: Sequence[int]) -> int:
        backend, matcher = self._backend, self._matcher
        if self._terminated or matcher.is_error():
            return 0
        tokens = list(tokens)
        for i, token in enumerate(tokens):  # nothing follows the first EOS
            if token in backend.eos_token_set:
                tokens = tokens[: i + 1]
                break
        if tokens and tokens[0] in backend.eos_token_set:
            # a stopped matcher (its grammar complete, nothing may follow) is not asked: it
            # counts no EOS, though the one it allows ends it
            return 1 if matcher.is_stopped() or matcher.is_accepting() else 0
        allowed = backend.allowed_prefix(tokens)
        if not allowed:
            return 0
        if backend.extra_eos and tokens[allowed - 1] in backend.eos_token_set:
            tokens[allowed - 1] = backend.primary_eos
        return matcher.validate_tokens(tokens[:allowed])

    def rollback(self, num_tokens: int) -> None:
        if num_tokens < 0 or num_tokens > self._accepted:
            raise ValueError(f"cannot roll back {num_tokens} tokens: the matcher has accepted {self._accepted}")
        if num_tokens == 0:
            return
        undo = num_tokens
        if self._terminated:
            if self._eos_kept:
                undo -= 1
            self._terminated = self._eos_kept = False
        if undo and not self._matcher.rollback(undo):
            raise RuntimeError(f"llguidance could not roll back {undo} tokens: {self._matcher.get_error()}")
        self._accepted -= num_tokens

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._backend.fill_bitmask([self], bitmask, [row])

    def is_terminated(self) -> bool:
        return self._terminated

    def can_terminate(self) -> bool:
        matcher = self._matcher
        return not self._terminated and not matcher.is_error() and matcher.is_accepting()

    def reset(self) -> None:
        self._matcher = self._compiled.prototype.deep_copy()
        self._accepted = 0
        self._terminated = self._eos_kept = False

    # for the engine's logs and the tests
    def is_error(self) -> bool:
        return self._matcher.is_error()

    def error(self) -> str:
        return self._matcher.get_error()


class LLGuidanceBackend(StructuredOutputBackend):
    """Compiles every constraint kind with llguidance.

    ``--structured-output-config`` keys: ``max_threads`` (threads filling a batch's masks;
    the engine's setting), ``lenient`` (JSON Schema keywords llguidance does not implement
    are ignored, with a warning in the log, instead of refused) and ``limits`` (llguidance's
    ``LLParserLimits`` fields).
    """

    name = "llguidance"

    def __init__(self, init: StructuredOutputInit) -> None:
        super().__init__(init)
        config = dict(init.config or {})
        unknown = sorted(set(config) - set(CONFIG_KEYS))
        if unknown:
            raise ValueError(
                f"Unknown llguidance setting {unknown[0]!r} in --structured-output-config; the settings are "
                f"{', '.join(CONFIG_KEYS)}."
            )
        lenient = config.get("lenient", False)
        if not isinstance(lenient, bool):
            raise ValueError(f"The llguidance setting 'lenient' must be true or false, got {lenient!r}.")
        self.lenient = lenient
        self.limits = _parser_limits(config.get("limits", {}))
        self.max_threads = max(1, int(init.max_threads))

        tokenizer = init.tokenizer
        text_tokens = len(tokenizer)
        eos = tuple(init.eos_token_ids) or ((tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ())
        eos = tuple(t for t in dict.fromkeys(eos) if 0 <= t < init.vocab_size)
        # llguidance knows the EOS tokens its tokenizer has; one the model has beyond it is
        # allowed wherever those are, and read as the first of them
        known_eos = [t for t in eos if t < text_tokens]
        if not known_eos:
            raise ValueError(
                "The llguidance backend needs an EOS token of the model that its tokenizer has; it has none."
            )
        self.eos_token_ids = eos
        self.eos_token_set = frozenset(eos)
        self._primary_eos = known_eos[0]
        self._extra_eos = tuple(t for t in eos if t >= text_tokens)
        # llguidance's vocabulary covers the tokenizer; when the model's logits are narrower,
        # masks are filled at the tokenizer's width and cut to the model's
        self._ll_vocab = max(init.vocab_size, text_tokens)
        try:
            self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self._ll_vocab, eos_token=known_eos)
        except ValueError as exc:
            raise ValueError(f"The llguidance backend cannot use this model's tokenizer: {exc}") from None
        # tokens that may ever be drawn: the tokenizer's, less its special tokens but EOS
        special = {t for t in getattr(tokenizer, "all_special_ids", ()) if 0 <= t < text_tokens}
        special.update(t for t in range(text_tokens) if self.tokenizer.is_special_token(t))
        special -= self.eos_token_set
        self.forbidden_tokens = frozenset(special)
        self.text_tokens = min(text_tokens, init.vocab_size)
        allowed = torch.zeros(bitmask_width(init.vocab_size) * 32, dtype=torch.bool)
        allowed[: self.text_tokens] = True
        if special:
            allowed[torch.tensor(sorted(special))] = False
        allowed[torch.tensor(eos)] = True
        self._universe = _pack(allowed)
        self._executor: Any = None
        self._executor_lock = threading.Lock()

    # compiling

    def compile(self, constraint: StructuredOutputsParams) -> CompiledConstraint:
        kind = constraint.kind
        if kind not in self.supported_kinds:
            raise ConstraintError(f"The llguidance backend does not support {kind} constraints.")
        return _on_large_stack(self._compile, constraint)

    def _compile(self, constraint: StructuredOutputsParams) -> CompiledConstraint:
        kind = constraint.kind
        try:
            grammar = self._grammar(constraint)
        except ConstraintError:
            raise
        except RecursionError:
            raise ConstraintError(f"The {kind} constraint is nested too deeply.") from None
        except Exception as exc:  # llguidance's own checks of what it was given
            raise ConstraintError(f"The {kind} constraint cannot be compiled: {_message(str(exc))}") from None
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits)
        if matcher.is_error():
            raise ConstraintError(f"The {kind} constraint is invalid for llguidance: {_message(matcher.get_error())}")
        warnings = tuple(matcher.get_grammar_warnings())
        if warnings:
            if not self.lenient:
                raise ConstraintError(f"The {kind} constraint is not supported by llguidance: {_message(warnings[0])}")
            logger.warning("llguidance: the %s constraint compiled with warnings: %s", kind, "; ".join(warnings))
        # the first mask: builds the lexer states the start needs here, off the step loop,
        # and finds a constraint too complex to start
        scratch = torch.empty(1, bitmask_width(self._ll_vocab), dtype=torch.int32)
        llguidance.torch.fill_next_token_bitmask(matcher, scratch, 0)
        if matcher.is_error():
            raise ConstraintError(
                f"The {kind} constraint is too complex for llguidance: {_message(matcher.get_error())}"
            )
        return CompiledConstraint(kind, grammar, matcher, warnings)

    def _grammar(self, constraint: StructuredOutputsParams) -> str:
        kind, spec, compact = constraint.kind, constraint.spec, constraint.disable_any_whitespace
        if kind == "json":
            return grammars.json_schema_grammar(spec, compact, self.lenient)
        if kind == "json_object":
            return grammars.json_schema_grammar({"type": "object"}, compact, self.lenient)
        if kind == "regex":
            return grammars.regex_grammar(spec)
        if kind == "choice":
            return grammars.choice_grammar(spec)
        if kind == "grammar":
            return grammars.ebnf_grammar(spec)
        if kind == "structural_tag":
            return grammars.structural_tag_grammar(spec, compact, self.lenient)
        raise ConstraintError(f"The llguidance backend does not support {kind} constraints.")

    # matching

    @property
    def primary_eos(self) -> int:
        """The EOS token llguidance is given for any of the model's."""
        return self._primary_eos

    @property
    def extra_eos(self) -> tuple[int, ...]:
        """EOS tokens of the model beyond its tokenizer."""
        return self._extra_eos

    def matcher(self, compiled: CompiledConstraint, max_rollback: int) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self, compiled, max_rollback)

    def allowed_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens``, from the first, are tokens that may ever be drawn."""
        forbidden, limit = self.forbidden_tokens, self.text_tokens
        for i, token in enumerate(tokens):
            if not 0 <= token < limit or token in forbidden:
                if token not in self.eos_token_set:
                    return i
        return len(tokens)

    def fill_bitmask(self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        if not matchers:
            return
        rows = list(rows)
        narrow = self._ll_vocab == self.vocab_size
        target = bitmask if narrow else torch.empty(len(rows), bitmask_width(self._ll_vocab), dtype=torch.int32)
        places = rows if narrow else list(range(len(rows)))
        if len(matchers) == 1:
            llguidance.torch.fill_next_token_bitmask(matchers[0]._matcher, target, places[0])
        else:
            llguidance.torch.fill_next_token_bitmask_par(
                self._get_executor(), [(m._matcher, place) for m, place in zip(matchers, places)], target
            )
        width = bitmask.shape[1]
        if narrow and len(rows) == 1:
            bitmask[rows[0]].bitwise_and_(self._universe)
        else:
            index = torch.tensor(rows, dtype=torch.long)
            source = bitmask[index] if narrow else target[:, :width]
            bitmask[index] = source & self._universe
        if self._extra_eos:
            self._mirror_eos(bitmask, rows)

    def _mirror_eos(self, bitmask: torch.Tensor, rows: list[int]) -> None:
        primary = self._primary_eos
        for row in rows:
            if int(bitmask[row, primary // 32]) >> (primary % 32) & 1:
                for token in self._extra_eos:
                    word = int(bitmask[row, token // 32]) & 0xFFFFFFFF | 1 << (token % 32)
                    bitmask[row, token // 32] = word - (1 << 32) if word >= 1 << 31 else word

    def _get_executor(self) -> Any:
        if self._executor is None:
            with self._executor_lock:
                if self._executor is None:
                    self._executor = llguidance.LLExecutor(self.max_threads)
        return self._executor

    def close(self) -> None:
        self._executor = None


def _pack(allowed: torch.Tensor) -> torch.Tensor:
    """bool [32 * W] -> int32 [W], bit t % 32 of word t // 32."""
    bits = allowed.view(-1, 32).to(torch.int64) << torch.arange(32, dtype=torch.int64)
    words = bits.sum(dim=1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _parser_limits(limits: Any) -> llguidance.LLParserLimits:
    if not isinstance(limits, dict):
        raise ValueError(f"The llguidance setting 'limits' must be an object, got {limits!r}.")
    unknown = sorted(set(limits) - set(LIMIT_KEYS))
    if unknown:
        raise ValueError(f"Unknown llguidance limit {unknown[0]!r}; the limits are {', '.join(LIMIT_KEYS)}.")
    for key, value in limits.items():
        if key in ("precompute_large_lexemes", "verbose_errors"):
            if not isinstance(value, bool):
                raise ValueError(f"The llguidance limit {key!r} must be true or false, got {value!r}.")
        elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"The llguidance limit {key!r} must be a positive integer, got {value!r}.")
    return llguidance.LLParserLimits(**limits)


def _message(text: str) -> str:
    text = text.strip()
    return text if len(text) <= MAX_MESSAGE_CHARS else text[:MAX_MESSAGE_CHARS] + " ..."


def _on_large_stack(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` on a new thread with :data:`COMPILE_STACK_BYTES` of stack; its
    result, or its exception."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = function(*args)
        except BaseException as exc:  # handed to the caller
            outcome["error"] = exc

    with _stack_lock:  # the stack size is process-wide: set it only around this thread's start
        try:
            previous = threading.stack_size(COMPILE_STACK_BYTES)
        except (ValueError, RuntimeError):  # a platform that does not let it be set
            previous = None
        try:
            thread = threading.Thread(target=run, name="engine-llguidance-compile", daemon=True)
            thread.start()
        finally:
            if previous is not None:
                threading.stack_size(previous)
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
