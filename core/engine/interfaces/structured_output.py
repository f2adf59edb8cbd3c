"""The structured-output backend interface: constraints compiled into per-request matchers
that say, token by token, what may come next.

A backend compiles a :class:`~engine.sampling_params.StructuredOutputsParams` once (the
engine caches the result by the constraint's ``key`` and compiles off the step loop), and
makes a fresh :class:`GrammarMatcher` from it for every request (each sample of ``n > 1``
has its own). The engine owns everything else: when matchers advance, which rows of a
step's logits are masked, and when a request ends.

The token bitmask is the one xgrammar and llguidance share: an ``int32`` tensor
``[rows, ceil(vocab_size / 32)]`` on the CPU; bit ``t % 32`` of word ``t // 32`` set
means token ``t`` may be drawn. ``vocab_size`` is the model's (its logits' width), which
may exceed the tokenizer's: tokens the tokenizer does not have are never allowed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Sequence

if TYPE_CHECKING:
    import torch

    from engine.sampling_params import StructuredOutputsParams


class ConstraintError(ValueError):
    """A constraint that cannot be compiled: an invalid schema, regex or grammar, a feature
    the backend does not support, or one over the engine's bounds. Its message names the
    problem and is shown to the client (a 400)."""


def bitmask_width(vocab_size: int) -> int:
    """Words of 32 bits per row of a token bitmask."""
    return (vocab_size + 31) // 32


@dataclass(frozen=True)
class StructuredOutputInit:
    """What a backend is built with.

    ``tokenizer``: the model's Hugging Face tokenizer (``transformers`` fast or slow);
    ``vocab_size``: the model's logits width; ``eos_token_ids``: the tokens that end the
    output when the constraint allows it to end; ``config``: the backend's own settings
    (``--structured-output-config``); ``max_threads``: threads it may use to compile.
    """

    tokenizer: Any
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    config: dict
    max_threads: int = 1


class GrammarMatcher(ABC):
    """One request's position in its constraint. Called by one thread at a time."""

    @abstractmethod
    def accept_tokens(self, tokens: Sequence[int]) -> bool:
        """Advance by ``tokens`` in order; False when one is not allowed (the matcher then
        stays after the tokens before it)."""

    @abstractmethod
    def validate_tokens(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens``, from the first, the constraint allows in order; the
        matcher does not move."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (at most the engine's
        ``max_rollback`` of :meth:`StructuredOutputBackend.matcher`)."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write into ``bitmask[row]`` the tokens allowed next (EOS only once the output
        may end; nothing but EOS once it must)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The constraint has ended: it accepted its end (EOS), nothing more may follow."""

    @abstractmethod
    def can_terminate(self) -> bool:
        """The output so far is a complete instance: EOS may come next."""

    @abstractmethod
    def reset(self) -> None:
        """Back to the start, as if no token had been accepted."""


class StructuredOutputBackend(ABC):
    """A constraint compiler. Register with ``register_structured_output_backends``; the
    engine picks one by ``--structured-output-backend`` (default: xgrammar where it is
    installed). One instance serves an engine; :meth:`compile` may be called from several
    threads at once, :meth:`matcher` and :meth:`fill_bitmask` from one at a time."""

    name: ClassVar[str]
    # the StructuredOutputsParams kinds it compiles (CONSTRAINT_KINDS, or fewer)
    supported_kinds: ClassVar[frozenset[str]] = frozenset(
        {"json", "json_object", "regex", "choice", "grammar", "structural_tag"}
    )

    def __init__(self, init: StructuredOutputInit) -> None:
        self.init = init
        self.vocab_size = init.vocab_size

    @abstractmethod
    def compile(self, constraint: StructuredOutputsParams) -> Any:
        """The compiled constraint, opaque to the engine and shared by every request with the
        same ``constraint.key``. Raises :class:`ConstraintError` for one that is invalid
        or uses what the backend does not support, with a message naming the problem."""

    @abstractmethod
    def matcher(self, compiled: Any, max_rollback: int) -> GrammarMatcher:
        """A fresh matcher at the start of ``compiled``, able to roll back ``max_rollback``
        tokens (speculative decoding's drafts)."""

    def fill_bitmask(self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        """The step's one call: fill ``bitmask[rows[i]]`` from ``matchers[i]`` for every i. A
        backend with a batched (multithreaded) fill overrides this."""
        for matcher, row in zip(matchers, rows):
            matcher.fill_bitmask(bitmask, row)

    def close(self) -> None:
        """Release threads and caches (called when the engine closes)."""
