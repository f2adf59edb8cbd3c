"""What one step runs and what it produced: the scheduler's batch, the model's output for
it, and the step's per-phase timings."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.runtime.request import Request

# the phases of a step, in order; StepTimings holds seconds for each
PHASES = ("schedule", "prepare", "forward", "logits", "sample", "update", "process")
# an input token the step before samples (async scheduling): the runner fills it in
PLACEHOLDER = -1


@dataclass
class ScheduledBatch:
    """What runs this step: ``requests[i]`` computes ``num_tokens[i]`` new tokens, then
    the speculative drafts ``drafts[i]`` (planned by the scheduler for decoding requests;
    ``draft_probs[i]`` the proposer's probabilities of them, or None). ``sample_indices``
    are the requests whose last scheduled token is their newest, so that they sample."""

    requests: list[Request] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    drafts: dict[int, list[int]] = field(default_factory=dict)
    draft_probs: dict[int, object] = field(default_factory=dict)
    sample_indices: list[int] = field(default_factory=list)
    # what the runner reads of each request, taken when the batch is made (with async scheduling
    # the requests move on while it runs): where its new tokens start, their ids (PLACEHOLDER for
    # the token the step before samples), its block table and recurrent-state slot
    context_lens: list[int] | None = None
    input_ids: list[list[int]] | None = None
    block_tables: list[list[int]] | None = None
    state_slots: list[int | None] | None = None
    # recurrent-state copies of prefix caching (engine.runtime.kv_cache_manager): (snapshot row, slot)
    # into the slots of requests starting from a cached prefix, before the forward; (slot, snapshot
    # row, block hash) of requests whose state this step leaves at a snapshot point, after it
    state_restores: list[tuple[int, int]] = field(default_factory=list)
    state_saves: list[tuple[int, int, bytes]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.requests)

    def snapshot(self, context_lens: list[int] | None = None) -> None:
        """Take what the runner reads of the requests now; ``context_lens`` where their new
        tokens start, if not at ``num_computed_tokens`` (a step still running computes those)."""
        if context_lens is None:
            context_lens = [r.num_computed_tokens for r in self.requests]
        self.context_lens = context_lens
        self.input_ids = []
        for request, start, n in zip(self.requests, context_lens, self.num_tokens):
            known = request.token_ids[start : start + n]
            self.input_ids.append(known + [PLACEHOLDER] * (n - len(known)))
        self.block_tables = [list(r.block_ids) for r in self.requests]
        self.state_slots = [r.state_slot for r in self.requests]

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens) + sum(len(d) for d in self.drafts.values())

    @property
    def decode_only(self) -> bool:
        return all(n == 1 for n in self.num_tokens)


@dataclass
class StepTimings:
    """Seconds spent in each phase of one step (``PHASES``): ``forward`` is the model's
    forward pass, ``logits`` its LM head, ``sample`` sampling and verification; ``prepare``
    building the step's tensors; ``schedule``, ``update`` and ``process`` the engine's
    bookkeeping. ``forward_tokens`` is the forward's token count."""

    schedule: float = 0.0
    prepare: float = 0.0
    forward: float = 0.0
    logits: float = 0.0
    sample: float = 0.0
    update: float = 0.0
    process: float = 0.0
    forward_tokens: int = 0

    @property
    def total(self) -> float:
        return sum(getattr(self, phase) for phase in PHASES)

    def as_dict(self) -> dict[str, float]:
        return {phase: getattr(self, phase) for phase in PHASES}


@dataclass
class ModelOutput:
    """The tokens a step sampled: ``requests[k]`` (those of ``batch.sample_indices``) keeps
    ``tokens[k]``, one token, or with drafts the accepted drafts and one more."""

    requests: list[Request] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)
    timings: StepTimings = field(default_factory=StepTimings)
    # (requests, LogprobsTensors) of the sampled requests without drafts, recorded by the output processor
    sample_logprobs: tuple | None = None
    # requests whose drafts were partly rejected and whose recurrent state the runner put back
    # to what it was before the step: the scheduler recomputes their kept tokens next step
    rewound: frozenset[str] = frozenset()
