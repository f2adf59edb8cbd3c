"""Turns a scheduled batch into flat tensors, runs the model, samples."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from engine.interfaces.attention import CommonAttentionMetadata
from engine.interfaces.forward_context import ForwardContext
from engine.interfaces.model import Model
from engine.runtime.batch import PLACEHOLDER, ModelOutput, ScheduledBatch, StepTimings
from engine.runtime.kv_cache import KVCache
from engine.runtime.logprobs import record_prompt_logprobs
from engine.runtime.reasoning import force_logits, may_force
from engine.runtime.request import Request
from engine.runtime.sampler import Sampler
from engine.runtime.structured_output import StepMasks, fill_step_masks, mask_logits
from engine.runtime.verify import verify


def select_rows(hidden: torch.Tensor, rows: slice | list[int]) -> torch.Tensor:
    """``hidden[rows]``; consecutive rows (every decode step's) as a view, without a gather."""
    if isinstance(rows, slice):
        return hidden[rows]
    if rows and rows == list(range(rows[0], rows[0] + len(rows))):
        return hidden[rows[0] : rows[0] + len(rows)]
    return hidden[torch.tensor(rows, device=hidden.device)]


def padded_block_table(tables: list[list[int]]) -> np.ndarray:
    """[num_seqs, longest table] int64, each table's row padded with zeros."""
    if len(tables) < PADDED_ROWS_MIN_SEQS:
        width = max(map(len, tables))
        return np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int64)
    # many rows: the tables' ids in one flat array, put in place by a mask of the valid columns
    lengths = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    table = np.zeros((len(tables), int(lengths.max())), dtype=np.int64)
    flat = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int64, count=int(lengths.sum()))
    table[np.arange(table.shape[1]) < lengths[:, None]] = flat
    return table


PADDED_ROWS_MIN_SEQS = 16  # fewer rows: padding Python lists costs less than the numpy calls


def step_arrays(
    input_ids: list[int],
    num_new: list[int],
    context: list[int],
    tables: list[list[int]],
    block_size: int,
    state_slots: list[int] | None = None,
) -> dict:
    """A step as the flat host arrays :meth:`ModelRunner.to_device` turns into tensors: each
    sequence's ``num_new`` tokens (``input_ids``, concatenated) at positions from its
    ``context`` on, written to the slots its block table (``tables``) gives them."""
    num_seqs = len(num_new)
    block_table = padded_block_table(tables)
    bs = block_size
    if all(n == 1 for n in num_new):
        # one token a sequence, at position context: a few Python lines cost less than the
        # dozen numpy calls of the general case, which make up most of a batch-1 step's inputs
        positions = np.asarray(context, dtype=np.int64)
        query_lens = np.ones(num_seqs, dtype=np.int64)
        context_lens = np.asarray(context, dtype=np.int64)
        seq_lens = context_lens + 1
        query_start_loc = np.arange(num_seqs + 1, dtype=np.int64)
        slot_mapping = np.asarray([t[p // bs] * bs + p % bs for t, p in zip(tables, context)], dtype=np.int64)
        max_query_len, max_seq_len = 1, max(context) + 1
    else:
        # index arithmetic in numpy: a dozen tiny torch ops cost more than the work at batch 1
        query_lens = np.asarray(num_new, dtype=np.int64)
        context_lens = np.asarray(context, dtype=np.int64)
        seq_lens = context_lens + query_lens
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        # token t belongs to sequence seq_idx[t], at position context + (t - query start)
        seq_idx = np.repeat(np.arange(num_seqs), query_lens)
        positions = np.arange(len(input_ids)) - query_start_loc[seq_idx] + context_lens[seq_idx]
        slot_mapping = block_table[seq_idx, positions // bs] * bs + positions % bs
        max_query_len, max_seq_len = max(num_new), int(seq_lens.max())
    return {
        "input_ids": np.asarray(input_ids, dtype=np.int64),
        "positions": positions,
        "query_start_loc": query_start_loc,
        "query_lens": query_lens,
        "context_lens": context_lens,
        "seq_lens": seq_lens,
        "block_tables": block_table,
        "slot_mapping": slot_mapping,
        "max_query_len": max_query_len,
        "max_seq_len": max_seq_len,
        "state_slots": np.asarray(state_slots, dtype=np.int64) if state_slots is not None else None,
    }


class ModelRunner:
    """With a ``channel`` (tensor parallelism, rank 0) every step's arrays and every logits
    computation are broadcast first, so that the other ranks run the same collectives.

    Each step's phases are timed (``ModelOutput.timings``); with ``synchronize`` (the
    platform's) each phase waits for the device first, so that the times are the device's."""

    def __init__(
        self,
        model: Model,
        kv_cache: KVCache,
        device: torch.device,
        channel=None,
        synchronize: Callable[[], None] | None = None,
    ) -> None:
        self.model = model
        self.synchronize = synchronize
        self._timings = StepTimings()
        self._sample_logprobs = None
        self._masks: StepMasks | None = None
        self.channel = channel
        self.in_step = False
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.device = device
        self.sampler = Sampler(device, kv_cache.ops)
        # hidden state of each request's newest token, for proposers that ask for it: the model's
        # output, or with keep_pre_head_hidden_states what the model keeps before its head
        self.keep_hidden_states = False
        self.keep_pre_head_hidden_states = False
        self.last_hidden: dict[str, torch.Tensor] = {}
        self.last_tokens: dict[str, int] = {}  # each request's token sampled by the last step
        # structured output: what has the backend (``.backend``) that fills constrained requests' masks, on
        # a thread of their own while the forward runs
        self.structured_output = None
        self._mask_thread: ThreadPoolExecutor | None = None
        # captured decode forwards (engine.runtime.graphs), replayed for the decode-only steps that fit
        self.graphs = None
        self.rewinds = 0  # drafted requests whose recurrent state was put back (a draft was rejected)
        self._recurrent_caches = [  # the state slots of the recurrent layers, which drafts run through
            cache for cache, backend in zip(kv_cache.layer_caches, kv_cache.layer_backends) if backend.spec.is_recurrent
        ]

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, CommonAttentionMetadata]:
        """input_ids [T], positions [T] and the step's attention metadata."""
        return self.to_device(self.prepare_arrays(batch))

    def prepare_arrays(self, batch: ScheduledBatch) -> dict:
        """The step as flat host arrays (what :meth:`to_device` turns into tensors)."""
        requests, num_new = batch.requests, batch.num_tokens
        if batch.context_lens is None:  # a batch made outside the scheduler (a proposer's)
            batch.snapshot()
        input_ids: list[int] = []
        context = batch.context_lens
        if batch.drafts:  # drafts run after their request's tokens, at the following positions
            num_new = [n + len(batch.drafts.get(i, ())) for i, n in enumerate(num_new)]
        for i, (request, ids) in enumerate(zip(requests, batch.input_ids)):
            if ids and ids[-1] == PLACEHOLDER:  # the token the step before sampled (async scheduling)
                ids = ids[:-1] + [self.last_tokens[request.request_id]]
            input_ids.extend(ids)
            input_ids.extend(batch.drafts.get(i, ()))
        state_slots = batch.state_slots if batch.state_slots[0] is not None else None
        arrays = step_arrays(input_ids, num_new, context, batch.block_tables, self.block_size, state_slots)
        # prefix caching of recurrent state: (from, to) row copies before and after the forward
        arrays["state_restores"] = batch.state_restores
        arrays["state_saves"] = [(slot, row) for slot, row, _ in batch.state_saves]
        return arrays

    def copy_states(self, pairs: list[tuple[int, int]]) -> None:
        """Copy rows of every recurrent layer's state cache: ``(source, destination)`` pairs
        (snapshot rows and request slots alike)."""
        if not pairs:
            return
        sources = torch.tensor([s for s, _ in pairs], device=self.device)
        destinations = torch.tensor([d for _, d in pairs], device=self.device)
        for cache in self._recurrent_caches:
            cache[destinations] = cache[sources]

    def to_device(self, arrays: dict) -> tuple[torch.Tensor, torch.Tensor, CommonAttentionMetadata]:
        device = self.device
        on_host = device.type == "cpu"

        def tensor(array: np.ndarray) -> torch.Tensor:
            host = torch.from_numpy(array)
            return host if on_host else host.to(device)

        metadata = CommonAttentionMetadata(
            query_start_loc=tensor(arrays["query_start_loc"]),
            query_lens=tensor(arrays["query_lens"]),
            context_lens=tensor(arrays["context_lens"]),
            seq_lens=tensor(arrays["seq_lens"]),
            block_tables=tensor(arrays["block_tables"]),
            slot_mapping=tensor(arrays["slot_mapping"]),
            max_query_len=arrays["max_query_len"],
            max_seq_len=arrays["max_seq_len"],
            block_size=self.block_size,
            state_slots=tensor(arrays["state_slots"]) if arrays["state_slots"] is not None else None,
        )
        return tensor(arrays["input_ids"]), tensor(arrays["positions"]), metadata

    def logits(self, hidden: torch.Tensor, rows: slice | list[int]) -> torch.Tensor:
        """The model's logits of ``hidden[rows]``. Under tensor parallelism the other ranks,
        which hold the same hidden states, are told the rows and compute their part too."""
        if self.channel is not None:
            self.channel.send(("logits", rows))
        start = self._clock()
        logits = self.model.compute_logits(select_rows(hidden, rows))
        self._timings.logits += self._clock() - start
        return logits

    def _clock(self) -> float:
        if self.synchronize is not None:
            self.synchronize()
        return time.perf_counter()

    @torch.inference_mode()
    def execute_arrays(self, arrays: dict) -> torch.Tensor:
        """A worker rank's step: the forward pass only (rank 0 samples); returns the hidden
        states the step's ``("logits", rows)`` messages select from."""
        input_ids, positions, common = self.to_device(arrays)
        self.copy_states(arrays.get("state_restores", ()))
        hidden = self.model(input_ids, positions, self._forward_context(common, arrays))
        self.copy_states(arrays.get("state_saves", ()))
        return hidden

    def _forward_context(self, common: CommonAttentionMetadata, arrays: dict) -> ForwardContext:
        ctx = self.kv_cache.forward_context(common)
        rows = arrays.get("output_rows")
        if rows is not None:
            ctx.output_rows = torch.from_numpy(rows).to(self.device)
        return ctx

    def _output_rows(self, batch: ScheduledBatch, arrays: dict) -> np.ndarray | None:
        """The rows whose final hidden states the step reads, for ``ForwardContext.output_rows``:
        in a step of prompt tokens where sampling alone reads them (no drafts, prompt logits or
        logprobs, nor hidden states kept for a proposer), each sampling request's last row, in
        ``sample_indices`` order (a step that samples nothing, only middle chunks of prompts,
        keeps its last row: no model sees an empty batch); None where that is every row or other
        rows are read."""
        if arrays["max_query_len"] == 1 or batch.drafts or self.keep_hidden_states:
            return None
        if any(r.needs_prompt_logits for r in batch.requests):
            return None
        ends = arrays["query_start_loc"][1:]
        rows = ends[batch.sample_indices] - 1 if batch.sample_indices else ends[-1:] - 1
        return rows if len(rows) < len(arrays["input_ids"]) else None

    def execute(self, batch: ScheduledBatch) -> ModelOutput:
        """Run one step: the forward pass over the batch, then sampling (and verification of
        drafts) for the requests of ``batch.sample_indices``. Reads request state, writes
        none of it but prompt logprobs and logits (the scheduler advances requests; the output
        processor records the sampled tokens' logprobs)."""
        self.in_step = True
        self._timings = timings = StepTimings()
        self._sample_logprobs = None
        self._rewound: set[str] = set()
        try:
            requests, tokens = self._execute(batch, timings)
        finally:
            self.in_step = False
        return ModelOutput(requests, tokens, timings, self._sample_logprobs, frozenset(self._rewound))

    @torch.inference_mode()
    def _execute(self, batch: ScheduledBatch, timings: StepTimings) -> tuple[list[Request], list[list[int]]]:
        start = self._clock()
        arrays = self.prepare_arrays(batch)
        arrays["output_rows"] = self._output_rows(batch, arrays)
        if self.channel is not None:
            self.channel.send(("forward", arrays))
        graph_size = self.graphs.fits(arrays) if self.graphs is not None else None
        if graph_size is None:
            input_ids, positions, common = self.to_device(arrays)
            ctx = self._forward_context(common, arrays)
        sampling = batch.sample_indices
        masks = self._start_masks(batch)
        states = self._snapshot_states(batch)
        self.copy_states(arrays["state_restores"])
        forward_start = self._clock()
        timings.prepare = forward_start - start
        if graph_size is not None:
            hidden = self.graphs.run(arrays, graph_size)
        else:
            hidden = self.model(input_ids, positions, ctx)
        self.copy_states(arrays["state_saves"])
        sample_start = self._clock()
        timings.forward, timings.forward_tokens = sample_start - forward_start, len(arrays["input_ids"])
        self._masks = masks.result() if masks is not None else None

        ends = arrays["query_start_loc"][1:].tolist()
        if arrays["output_rows"] is not None and hidden.shape[0] != len(arrays["input_ids"]):
            # the model kept the sampling requests' last rows alone, in sample_indices order
            ends = [0] * len(batch.requests)
            for row, i in enumerate(batch.sample_indices):
                ends[i] = row + 1
        if any(r.want_prompt_logits for r in batch.requests):
            self._record_prompt_logits(batch, hidden, ends)
        if any(r.sampling_params.prompt_logprobs is not None for r in batch.requests):
            record_prompt_logprobs(lambda rows: self.logits(hidden, rows), batch.requests, batch.num_tokens, ends)
        if not sampling:
            return [], []
        requests = [batch.requests[i] for i in sampling]
        plain = [i for i in sampling if not batch.drafts.get(i)]
        drafted = [i for i in sampling if batch.drafts.get(i)]
        tokens = dict(zip(plain, self._sample(batch, plain, hidden, ends))) if plain else {}
        if drafted:
            tokens.update(zip(drafted, self._verify(batch, drafted, hidden, ends)))
            self._rewind_states(batch, states, tokens)
        timings.sample = self._clock() - sample_start - timings.logits
        kept = [tokens[i] for i in sampling]
        self.last_tokens = {request.request_id: t[-1] for request, t in zip(requests, kept)}
        return requests, kept

    def _snapshot_states(self, batch: ScheduledBatch) -> dict[int, list[torch.Tensor]] | None:
        """Before a step with drafts: each drafted request's recurrent state (the convolution
        inputs and the delta-rule matrix of every recurrent layer), which its drafts will run
        through. A rejected draft has then advanced the state past tokens the request does
        not keep, and :meth:`_rewind_states` puts it back."""
        if not batch.drafts or not self._recurrent_caches:
            return None
        return {i: [cache[batch.state_slots[i]].clone() for cache in self._recurrent_caches] for i in batch.drafts}

    def _rewind_states(
        self, batch: ScheduledBatch, states: dict[int, list[torch.Tensor]] | None, tokens: dict[int, list[int]]
    ) -> None:
        """Requests that kept fewer tokens than their drafts get the state they had before the
        step; the scheduler then has them recompute the tokens they kept (``ModelOutput.rewound``)."""
        if states is None:
            return
        for i, rows in states.items():
            if len(tokens[i]) - 1 < len(batch.drafts[i]):  # a draft was rejected
                for cache, row in zip(self._recurrent_caches, rows):
                    cache[batch.state_slots[i]].copy_(row)
                self._rewound.add(batch.requests[i].request_id)
                self.rewinds += 1

    def _start_masks(self, batch: ScheduledBatch) -> Future[StepMasks | None] | None:
        """The constrained requests' masks, filled on the mask thread while the forward runs."""
        if self.structured_output is None or not any(batch.requests[i].grammar for i in batch.sample_indices):
            return None
        if self._mask_thread is None:
            self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="engine-masks")
        backend = self.structured_output.backend
        return self._mask_thread.submit(fill_step_masks, backend, batch.requests, batch.sample_indices, batch.drafts)

    def close(self) -> None:
        if self._mask_thread is not None:
            self._mask_thread.shutdown()
            self._mask_thread = None

    def _sample(
        self, batch: ScheduledBatch, indices: list[int], hidden: torch.Tensor, ends: list[int]
    ) -> list[list[int]]:
        """Requests ``indices`` of the batch, without drafts, sample one token each from the
        logits of their last row (masked where a request's output is constrained)."""
        requests = [batch.requests[i] for i in indices]
        rows = [ends[i] - 1 for i in indices]
        picks = self._greedy_tokens(requests, hidden, rows)
        if picks is not None:
            self._keep_hidden(requests, hidden, rows)
            return [[t] for t in picks.tolist()]
        logits = self.logits(hidden, rows)
        mask_logits(logits, self._masks, indices, [1] * len(indices), self.sampler.ops)
        force_logits(logits, requests)  # a spent thinking budget: the closing tokens
        sampled = self.sampler(logits, requests)
        if sampled.logprobs is not None:  # recorded by the output processor, on the engine's thread
            self._sample_logprobs = (requests, sampled.logprobs)
        self._keep_hidden(requests, hidden, rows)
        return [[t] for t in sampled.token_ids.tolist()]

    def _greedy_tokens(self, requests: list[Request], hidden: torch.Tensor, rows: list[int]) -> torch.Tensor | None:
        """The model's greedy picks of ``hidden[rows]`` without logits
        (``Model.compute_greedy_tokens``), when sampling would take the argmax of the logits as
        the model gives them (plain greedy requests, no output constraint, no forced token) on a
        single rank; None otherwise, or where the model has no such path."""
        pick = getattr(self.model, "compute_greedy_tokens", None)
        if pick is None or self.channel is not None or self._masks is not None:
            return None
        if not self.sampler.plain_greedy(requests) or any(may_force(r) for r in requests):
            return None
        start = self._clock()
        picks = pick(select_rows(hidden, rows))
        if picks is not None:
            self._timings.logits += self._clock() - start
        return picks

    def _verify(
        self, batch: ScheduledBatch, drafted: list[int], hidden: torch.Tensor, ends: list[int]
    ) -> list[list[int]]:
        """Requests ``drafted`` are verified on the logits of their last token and every draft."""
        requests = [batch.requests[i] for i in drafted]
        rows = [r for i in drafted for r in range(ends[i] - len(batch.drafts[i]) - 1, ends[i])]
        logits = self.logits(hidden, rows)
        mask_logits(logits, self._masks, drafted, [len(batch.drafts[i]) + 1 for i in drafted], self.sampler.ops)
        kept = verify(
            self.sampler,
            logits,
            requests,
            [batch.drafts[i] for i in drafted],
            [batch.draft_probs.get(i) for i in drafted],
        )
        if self.keep_hidden_states:  # the row that produced each request's newest token
            last = [ends[i] - len(batch.drafts[i]) - 1 + len(k) - 1 for i, k in zip(drafted, kept)]
            self._keep_hidden(requests, hidden, last)
        return kept

    def _keep_hidden(self, requests: list[Request], hidden: torch.Tensor, rows: list[int]) -> None:
        if self.keep_hidden_states:
            if self.keep_pre_head_hidden_states:
                hidden = self.model.pre_head_hidden_states
            for request, row in zip(requests, select_rows(hidden, rows)):
                self.last_hidden[request.request_id] = row.clone()

    def _record_prompt_logits(self, batch: ScheduledBatch, hidden: torch.Tensor, ends: list[int]) -> None:
        start = 0
        for request, n, end in zip(batch.requests, batch.num_tokens, ends):
            if request.want_prompt_logits:
                first = request.num_computed_tokens
                keep = max(0, min(n, request.num_prompt_tokens - first))
                if keep:
                    request.prompt_logits.append(self.logits(hidden, slice(start, start + keep)).float())
            start = end
