"""How a process joins the tensor-parallel group (spawned by rank 0, or started by
torchrun), and the control channel over which rank 0 sends each step to the other ranks.
The workers themselves (spawning, watching, their loop) are ``engine.engine.workers``;
rank 0's side is ``engine.engine.ranks``."""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from engine.distributed.parallel_state import TensorParallel
from engine.errors import WorkerDiedError

__all__ = [
    "COLLECTIVE_TIMEOUT",
    "STUCK_STEP_GRACE_S",
    "ControlChannel",
    "Launch",
    "WorkerDiedError",
    "free_local_address",
    "join_group",
    "leave_group",
    "raised_by_collective",
    "torchrun_launch",
]

logger = logging.getLogger("engine.distributed")

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# how long a collective may wait for a peer before torch.distributed gives up
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
# after a worker died, how long a step may stay stuck before the process exits
STUCK_STEP_GRACE_S = 10.0


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
        raise ValueError(
            f"RANK and WORLD_SIZE are set but {', '.join(missing)} not: set every one of "
            f"{', '.join(TORCHRUN_VARIABLES)} (torchrun does), or none."
        )
    return Launch(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://")


def free_local_address() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"


READY_KEY = "engine/ranks_ready"


def join_group(launch: Launch, backend: str, workers: Any = None) -> TensorParallel:
    """Initialise ``torch.distributed`` for this rank; layers' collectives use ``backend``
    (the platform's), step messages a gloo group.

    Spawned ranks meet at rank 0's store: each checks in, and rank 0 waits for all of them
    while watching ``workers``, so that a rank dying before it joins (a plugin that fails to
    import there, ...) is a prompt :class:`WorkerDiedError` rather than a rendezvous that
    waits out its timeout."""
    import torch.distributed as dist

    if launch.init_method.startswith("tcp://"):
        host, port = launch.init_method.removeprefix("tcp://").rsplit(":", 1)
        store = dist.TCPStore(
            host,
            int(port),
            world_size=launch.world_size,
            is_master=launch.rank == 0,
            timeout=COLLECTIVE_TIMEOUT,
            wait_for_workers=False,
        )
        if launch.rank == 0:
            wait_for_ranks(store, launch.world_size - 1, workers)
        else:
            store.add(READY_KEY, 1)
        dist.init_process_group(
            backend, store=store, rank=launch.rank, world_size=launch.world_size, timeout=COLLECTIVE_TIMEOUT
        )
    else:
        dist.init_process_group(
            backend,
            init_method=launch.init_method,
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=COLLECTIVE_TIMEOUT,
        )
    control = None if backend == "gloo" else dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
    logger.info("tensor-parallel rank %d of %d joined (%s)", launch.rank, launch.world_size, backend)
    return TensorParallel(rank=launch.rank, size=launch.world_size, group=None, control_group=control)


def wait_for_ranks(store, expected: int, workers: Any) -> None:
    """Until ``expected`` ranks checked in at ``store``; a dead worker raises."""
    deadline = time.monotonic() + COLLECTIVE_TIMEOUT.total_seconds()
    while store.add(READY_KEY, 0) < expected:
        if workers is not None and workers.failure is not None:
            raise WorkerDiedError(f"{workers.failure} before joining the tensor-parallel group; its log says why")
        if time.monotonic() > deadline:
            raise WorkerDiedError(
                f"only {store.add(READY_KEY, 0)} of {expected} tensor-parallel ranks joined within {COLLECTIVE_TIMEOUT}"
            )
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
