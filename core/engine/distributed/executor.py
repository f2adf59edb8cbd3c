"""Running one model shard per rank: how a process joins the tensor-parallel group, the
workers rank 0 spawns, and the loop a worker runs.

Rank 0 is the engine: it schedules, runs its shard, samples and answers requests. Every
step it broadcasts the step's flat input arrays to the other ranks over a gloo group
(``("forward", arrays)``), each time it needs logits which rows of the step's hidden
states they are for (``("logits", rows)``: every rank has the same hidden states), and each time its KV tier moves blocks which ones (``("kv_gather",
blocks)``, ``("kv_write", blocks, rows)``: each rank gives or takes its KV heads), so that
every rank runs the same collectives in the same order. The other ranks hold no requests: they build the same engine from the same
configuration (the plugin selection included, resolved to names on rank 0), then run
:func:`serve_steps` until rank 0 says ``("stop",)`` or goes away.

Two ways to start the ranks:

- ``--tensor-parallel-size N`` alone: rank 0 spawns ranks 1..N-1 on this machine (spawn,
  never fork) and they meet at a free port on 127.0.0.1. A watchdog thread sees a worker
  exit; the step that waits on it fails (gloo reports the closed connection at once), and
  if a step is still stuck after a grace period the process exits with status 1.
- under ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set), one
  process per rank on any number of machines: rank 0 serves, the others run the worker loop.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from engine.distributed.parallel_state import TensorParallel

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.runtime.llm_engine import LLMEngine

logger = logging.getLogger("engine.distributed")

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# how long a collective may wait for a peer before torch.distributed gives up
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
# after a worker died, how long a step may stay stuck before the process exits
STUCK_STEP_GRACE_S = 10.0


class WorkerDiedError(RuntimeError):
    """A tensor-parallel rank went away: the engine cannot go on."""


@dataclass(frozen=True)
class Launch:
    """How this process joins the group: its rank, the group's size, and where to meet
    (``env://`` under torchrun, ``tcp://127.0.0.1:PORT`` for spawned workers)."""

    rank: int
    world_size: int
    init_method: str


def torchrun_launch() -> Launch | None:
    """The launch torchrun (or any launcher setting its variables) describes, else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
    if missing:
        raise ValueError(f"RANK and WORLD_SIZE are set but {', '.join(missing)} not: set every one of "
                         f"{', '.join(TORCHRUN_VARIABLES)} (torchrun does), or none.")
    return Launch(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://")


def free_local_address() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"


READY_KEY = "engine/ranks_ready"


def join_group(launch: Launch, backend: str, workers: LocalWorkers | None = None) -> TensorParallel:
    """Initialise ``torch.distributed`` for this rank; layers' collectives use ``backend``
    (the platform's), step messages a gloo group.

    Spawned ranks meet at rank 0's store: each checks in, and rank 0 waits for all of them
    while watching ``workers``, so that a rank dying before it joins (a plugin that fails to
    import there, ...) is a prompt :class:`WorkerDiedError` rather than a rendezvous that
    waits out its timeout."""
    import torch.distributed as dist

    if launch.init_method.startswith("tcp://"):
        host, port = launch.init_method.removeprefix("tcp://").rsplit(":", 1)
        store = dist.TCPStore(host, int(port), world_size=launch.world_size, is_master=launch.rank == 0,
                              timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False)
        if launch.rank == 0:
            wait_for_ranks(store, launch.world_size - 1, workers)
        else:
            store.add(READY_KEY, 1)
        dist.init_process_group(backend, store=store, rank=launch.rank, world_size=launch.world_size,
                                timeout=COLLECTIVE_TIMEOUT)
    else:
        dist.init_process_group(backend, init_method=launch.init_method, rank=launch.rank,
                                world_size=launch.world_size, timeout=COLLECTIVE_TIMEOUT)
    control = None if backend == "gloo" else dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
    logger.info("tensor-parallel rank %d of %d joined (%s)", launch.rank, launch.world_size, backend)
    return TensorParallel(rank=launch.rank, size=launch.world_size, group=None, control_group=control)


def wait_for_ranks(store, expected: int, workers: LocalWorkers | None) -> None:
    """Until ``expected`` ranks checked in at ``store``; a dead worker raises."""
    deadline = time.monotonic() + COLLECTIVE_TIMEOUT.total_seconds()
    while store.add(READY_KEY, 0) < expected:
        if workers is not None and workers.failure is not None:
            raise WorkerDiedError(f"{workers.failure} before joining the tensor-parallel group; its log says why")
        if time.monotonic() > deadline:
            raise WorkerDiedError(f"only {store.add(READY_KEY, 0)} of {expected} tensor-parallel ranks joined "
                                  f"within {COLLECTIVE_TIMEOUT}")
        time.sleep(0.05)


def raised_by_collective(exc: BaseException) -> bool:
    """Whether ``exc`` came out of a ``torch.distributed`` call (a peer that went away makes
    gloo raise a plain ``RuntimeError``, so the traceback tells, not the type)."""
    marker = os.sep.join(("torch", "distributed", ""))
    tb = exc.__traceback__
    while tb is not None:
        if marker in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


def leave_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a peer already gone: nothing left to tear down cleanly
            logger.debug("destroying the process group failed", exc_info=True)


class ControlChannel:
    """Rank 0's step messages to the other ranks (a broadcast over the control group)."""

    def __init__(self, tp: TensorParallel) -> None:
        self.tp = tp

    def send(self, message: tuple) -> None:
        import torch.distributed as dist

        dist.broadcast_object_list([message], src=0, group=self.tp.control_group)

    def receive(self) -> tuple:
        import torch.distributed as dist

        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.tp.control_group)
        return box[0]

    def gather(self, tensor) -> list:
        """Every rank's ``tensor`` (equal shapes) on rank 0, in rank order; [] elsewhere."""
        import torch
        import torch.distributed as dist

        parts = [torch.empty_like(tensor) for _ in range(self.tp.size)] if self.tp.rank == 0 else None
        dist.gather(tensor.contiguous(), parts, dst=0, group=self.tp.control_group)
        return parts or []

    def agree_on_min(self, value: int) -> int:
        """The smallest of every rank's ``value`` (e.g. how many KV blocks fit)."""
        import torch
        import torch.distributed as dist

        box = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(box, op=dist.ReduceOp.MIN, group=self.tp.control_group)
        return int(box.item())


def _worker_entry(config_json: str, launch: Launch) -> None:
    """Target of a spawned worker process."""
    from engine.config import EngineConfig

    logging.basicConfig(level=logging.WARNING, format=f"[rank {launch.rank}] %(levelname)s %(name)s: %(message)s")
    run_worker(EngineConfig.model_validate_json(config_json), launch)


def run_worker(config: EngineConfig, launch: Launch) -> None:
    """Build rank ``launch.rank``'s shard of the engine and serve rank 0's steps."""
    from engine.runtime.llm_engine import LLMEngine

    engine = LLMEngine(config, progress=False, launch=launch)
    try:
        serve_steps(engine)
    finally:
        leave_group()


def serve_steps(engine: LLMEngine) -> None:
    """A worker's loop: run each step rank 0 broadcasts until it says stop."""
    from engine.runtime.model_runner import select_rows

    channel, runner = engine.channel, engine.runner
    hidden = None
    while True:
        message = channel.receive()
        kind = message[0]
        if kind == "forward":
            hidden = runner.execute_arrays(message[1])
        elif kind == "logits":  # rows of this step's hidden states, the same on every rank
            runner.model.compute_logits(select_rows(hidden, message[1]))
        elif kind == "kv_gather":  # the KV tier on rank 0 stores blocks: this rank's heads of them
            channel.gather(engine.kv_blocks.local(message[1]))
        elif kind == "kv_write":  # ... or loads blocks: this rank takes its heads
            engine.kv_blocks.write(message[1], message[2])
        elif kind == "stop":
            return
        else:
            raise RuntimeError(f"unknown step message {kind!r} from rank 0")


class LocalWorkers:
    """Ranks 1..N-1 spawned on this machine by rank 0, and a thread watching them."""

    def __init__(self, config: EngineConfig, world_size: int, init_method: str,
                 on_death: Callable[[str], None]) -> None:
        context = multiprocessing.get_context("spawn")
        config_json = config.model_dump_json()
        self.processes = [
            context.Process(target=_worker_entry, args=(config_json, Launch(rank, world_size, init_method)),
                            name=f"engine-tp-rank-{rank}", daemon=True)
            for rank in range(1, world_size)
        ]
        for process in self.processes:
            process.start()
            logger.info("started %s (pid %d)", process.name, process.pid)
        self.stopping = threading.Event()
        self.failure: str | None = None
        self.on_death = on_death
        self.watchdog = threading.Thread(target=self._watch, name="engine-tp-watchdog", daemon=True)
        self.watchdog.start()

    def _watch(self) -> None:
        from multiprocessing.connection import wait

        alive = {process.sentinel: process for process in self.processes}
        while alive and not self.stopping.is_set():
            for sentinel in wait(list(alive), timeout=0.5):
                process = alive.pop(sentinel)
                if self.stopping.is_set():
                    return
                process.join(1.0)  # reap it, so that its exit status is known
                self.failure = (f"tensor-parallel worker {process.name} (pid {process.pid}) exited with status "
                                f"{process.exitcode}")
                logger.error("%s; the engine cannot go on", self.failure)
                self.on_death(self.failure)
                return

    def stop(self, timeout: float = 10.0) -> None:
        self.stopping.set()
        deadline = time.monotonic() + timeout
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.terminate()
                process.join(2.0)
