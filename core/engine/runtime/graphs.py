"""Decode steps replayed from captured device graphs (CUDA graphs on cuda).

A batch-1 decode step launches a few hundred small kernels; on a GPU their launch costs
exceed their work. At start-up the model's decode forward is captured once per padded batch
size (:func:`graph_batch_sizes`: 1, 2, 4, 8, then steps of 8 up to ``max_num_seqs``, capped
by ``--cuda-graph-max-bs``), reading its inputs from static buffers; a decode-only step
whose batch fits is copied into those buffers (rows past the batch padded: token 0 at
position 0 of a sequence whose only block is the KV cache's spare block, so their writes
touch no request's cache) and replays the graph of the smallest size that holds it. Any
other step (prompt tokens, drafts, a larger batch, a block table wider than captured) runs
eagerly. ``--enforce-eager`` captures nothing.

The platform supplies the graphs (:meth:`Platform.device_graphs`); the attention backends'
``build_metadata`` and ``forward`` run inside the capture, so for decode-only metadata they
must not synchronise with the host (no ``.tolist()``/``.item()``), and the step's
``max_seq_len`` is captured as ``max_model_len``.

A graph class with ``capture_on_first_use = True`` (the CPU's, whose capture is a recorded run
of the forward, costing no more than running it) is not captured at start-up: the first
decode step of each padded size captures it, the capture computing that step's hidden states.
Its ``capture`` may raise :class:`UncapturableStep` (with the step's output, computed in full)
when the forward did something a replay cannot repeat, such as reading a tensor's values on
the host, and its ``replay`` :class:`StaleGraph` when it finds the forward's work changed
since the capture (the step then runs eagerly); decode steps run eagerly from there on, and
the log says why.
"""

from __future__ import annotations

import bisect
import logging
from typing import Any, Callable, Protocol

import numpy as np
import torch

from engine.interfaces.attention import CommonAttentionMetadata

logger = logging.getLogger("engine")

DEFAULT_MAX_BATCH = 512


class UncapturableStep(Exception):
    """Raised by a graph's ``capture`` whose forward cannot be replayed (``reason``); ``output``
    is what the forward returned, computed in full, for the step being captured."""

    def __init__(self, reason: str, output: torch.Tensor) -> None:
        super().__init__(reason)
        self.reason, self.output = reason, output


class StaleGraph(Exception):
    """Raised by a graph's ``replay`` that found the forward no longer matches its capture (an
    op's output took another shape); the step's forward is then run eagerly."""


class DeviceGraph(Protocol):
    """One captured graph: ``capture(fn)`` runs ``fn`` under capture and returns its output
    (tensors that each ``replay()`` refills)."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor: ...

    def replay(self) -> None: ...


def graph_batch_sizes(max_num_seqs: int, max_batch: int | None = None) -> list[int]:
    """The padded batch sizes captured: 1, 2, 4, 8, then every multiple of 8, up to
    ``max_num_seqs`` capped by ``max_batch`` (default 512), the cap itself included."""
    cap = min(max_num_seqs, max_batch if max_batch is not None else DEFAULT_MAX_BATCH)
    if cap < 1:
        raise ValueError(f"cuda_graph_max_bs must be at least 1, got {max_batch}.")
    sizes = [s for s in (1, 2, 4, 8) if s <= cap] + list(range(16, cap + 1, 8))
    if sizes[-1] != cap:
        sizes.append(cap)
    return sizes


def padded_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds ``num_seqs`` rows, or None when none does."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


class DecodeGraphs:
    """The captured decode forwards of one model and KV cache, sharing static inputs sized
    for the largest batch."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: Any,
        device: torch.device,
        sizes: list[int],
        *,
        max_model_len: int,
        block_size: int,
        make_graph: Callable[[], DeviceGraph],
    ) -> None:
        if not kv_cache.spare_block_ids:
            raise ValueError("Decode graphs need a KV cache with a spare block for their padding rows.")
        self.model, self.kv_cache, self.device = model, kv_cache, device
        self.sizes = sizes
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // block_size)
        self.spare_block = kv_cache.spare_block_ids[0]
        self.make_graph = make_graph
        largest = sizes[-1]

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        self.input_ids, self.positions = zeros(largest), zeros(largest)
        self.context_lens, self.seq_lens, self.slot_mapping = zeros(largest), zeros(largest), zeros(largest)
        self.block_tables = zeros(largest, self.max_blocks)
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int64, device=device)
        self.query_lens = torch.ones(largest, dtype=torch.int64, device=device)
        # the host side of the static inputs each step refills: on the CPU the tensors themselves,
        # elsewhere staging arrays copied over; what padding rows hold; how many columns of the
        # block tables any step has written (the rest are still zero)
        names = ("input_ids", "positions", "context_lens", "seq_lens", "slot_mapping", "block_tables")
        self._host = {
            name: getattr(self, name).numpy() if device.type == "cpu" else np.zeros(getattr(self, name).shape, np.int64)
            for name in names
        }
        self._padding = {"input_ids": 0, "positions": 0, "context_lens": 0, "seq_lens": 1}
        self._padding["slot_mapping"] = self.spare_block * block_size
        self._written_width = 0
        self.graphs: dict[int, DeviceGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0  # decode steps served by a graph
        # captured by the first decode step of each size rather than at start-up (UncapturableStep: off)
        self.on_first_use = bool(getattr(make_graph, "capture_on_first_use", False))
        self.disabled = False
        self.paused = False  # steps run eagerly meanwhile (a run timing modules by their hooks)

    def _forward(self, size: int) -> torch.Tensor:
        common = CommonAttentionMetadata(
            query_start_loc=self.query_start_loc[: size + 1],
            query_lens=self.query_lens[:size],
            context_lens=self.context_lens[:size],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            slot_mapping=self.slot_mapping[:size],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            block_size=self.block_size,
        )
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_cache.forward_context(common))

    def _fill(self, arrays: dict | None, size: int) -> None:
        """The static inputs of a ``size`` batch: the step's rows first (``arrays`` as the
        runner builds them; None: none), padding rows after them."""
        n = 0 if arrays is None else len(arrays["input_ids"])
        host = self._host
        for name, pad in self._padding.items():
            values = host[name]
            if n:
                values[:n] = arrays[name]
            values[n:size] = pad
        tables, written = host["block_tables"], self._written_width
        width = 0
        if n:
            width = arrays["block_tables"].shape[1]
            tables[:n, :width] = arrays["block_tables"]
            tables[:n, width:written] = 0
        tables[n:size, :written] = 0
        tables[n:size, 0] = self.spare_block
        self._written_width = max(written, width, 1)
        if self.device.type != "cpu":
            for name, values in host.items():
                getattr(self, name)[:size].copy_(torch.from_numpy(values[:size]), non_blocking=False)

    @torch.inference_mode()
    def capture(self, progress: bool = True) -> None:
        """Capture every size, largest first, each after one eager warm-up run (kernels
        compile and allocate outside the capture)."""
        from tqdm.auto import tqdm

        if self.on_first_use:
            logger.info("decode graphs are captured by the first decode step of each batch size")
            return
        for size in tqdm(list(reversed(self.sizes)), desc="Capturing decode graphs", disable=not progress):
            self._fill(None, size)
            self._forward(size)  # warm-up
            graph = self.make_graph()
            self.outputs[size] = graph.capture(lambda size=size: self._forward(size))
            self.graphs[size] = graph
        logger.info("captured decode graphs for %d batch sizes (%s)", len(self.sizes), ", ".join(map(str, self.sizes)))

    def fits(self, arrays: dict) -> int | None:
        """The captured size that replays this step, or None when it must run eagerly."""
        if self.paused or arrays["max_query_len"] != 1 or arrays["state_slots"] is not None:
            return None
        if arrays["block_tables"].shape[1] > self.max_blocks:
            return None
        if len(arrays["input_ids"]) != len(arrays["query_lens"]):  # a sequence without a token this step
            return None
        size = padded_size(len(arrays["input_ids"]), self.sizes)
        if size in self.graphs or (size is not None and self.on_first_use and not self.disabled):
            return size
        return None

    def run(self, arrays: dict, size: int) -> torch.Tensor:
        """The hidden states of a decode-only step from the graph of ``size`` (what
        :meth:`fits` answered for it): [num_seqs, hidden], a view of the graph's output that
        the next replay overwrites."""
        self._fill(arrays, size)
        rows = len(arrays["input_ids"])
        if size not in self.graphs:
            graph = self.make_graph()
            try:
                output = graph.capture(lambda: self._forward(size))
            except UncapturableStep as refused:
                self._disable(f"the forward cannot be captured ({refused.reason})")
                return refused.output[:rows]
            self.graphs[size], self.outputs[size] = graph, output
            return output[:rows]
        try:
            self.graphs[size].replay()
        except StaleGraph as stale:
            self._disable(str(stale))
            return self._forward(size)[:rows]
        self.replays += 1
        return self.outputs[size][:rows]

    def _disable(self, reason: str) -> None:
        self.disabled = True
        self.graphs.clear()  # what they hold is freed
        self.outputs.clear()
        logger.info("decode steps run eagerly: %s", reason)
