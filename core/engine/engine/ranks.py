"""Rank 0's side of tensor parallelism: starting the other ranks (spawned here, or met
under torchrun), joining the group, watching for a rank that dies, and stopping them."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from engine.distributed.executor import (
    STUCK_STEP_GRACE_S,
    ControlChannel,
    Launch,
    free_local_address,
    join_group,
    leave_group,
    raised_by_collective,
    torchrun_launch,
)
from engine.distributed.parallel_state import SINGLE, TensorParallel
from engine.engine.setup import EngineSetup, check_tensor_parallel
from engine.engine.workers import LocalWorkers
from engine.errors import WorkerDiedError

logger = logging.getLogger("engine")


class Ranks:
    """This process as rank 0 of ``size`` (one rank: nothing to do). ``in_step`` tells the
    watchdog whether a step may be stuck on a dead rank."""

    def __init__(self, setup: EngineSetup, loaded_plugins: list[str], in_step: Callable[[], bool]) -> None:
        self.tp: TensorParallel = SINGLE
        self.channel: ControlChannel | None = None
        self.workers: LocalWorkers | None = None
        self._in_step = in_step
        self._launch: Launch | None = None
        config, size = setup.config, setup.config.tensor_parallel_size
        launch = torchrun_launch()
        if launch is not None and launch.world_size != size:
            raise ValueError(
                f"This process was started as rank {launch.rank} of WORLD_SIZE={launch.world_size} "
                f"(torchrun), but --tensor-parallel-size is {size}: make them equal."
            )
        if size == 1:
            return
        check_tensor_parallel(setup)
        if launch is None:  # spawn ranks 1..N-1 here; they load exactly the plugins this process loaded
            init_method = free_local_address()
            self.workers = LocalWorkers(
                config.model_copy(update={"plugins": loaded_plugins}), size, init_method, self._on_worker_death
            )
            launch = Launch(0, size, init_method)
        self._launch = launch

    def join(self, dist_backend: str) -> None:
        if self._launch is None:
            return
        self.tp = join_group(self._launch, dist_backend, self.workers)
        self.channel = ControlChannel(self.tp)

    def _on_worker_death(self, reason: str) -> None:
        """Called on the watchdog thread: a step waiting on the dead rank fails by itself
        (gloo sees the closed connection); one still stuck after a grace period ends the
        process, since a hung server is worse than a dead one."""

        def exit_if_stuck() -> None:
            if self._in_step():
                logger.critical(
                    "%s and the step waiting on it is stuck after %.0f s: exiting", reason, STUCK_STEP_GRACE_S
                )
                os._exit(1)

        timer = threading.Timer(STUCK_STEP_GRACE_S, exit_if_stuck)
        timer.daemon = True
        timer.start()

    def check(self) -> None:
        """Raise ``WorkerDiedError`` when a spawned rank has exited (cheap: a flag the watchdog sets)."""
        if self.workers is not None and self.workers.failure is not None:
            raise WorkerDiedError(self.workers.failure)

    def step_failed(self, exc: RuntimeError) -> None:
        """A step raised ``exc``: re-raise it as ``WorkerDiedError`` when a lost rank caused it."""
        if not (self.tp.is_parallel and raised_by_collective(exc)):
            return  # the step's own error (out of memory, a model bug), not a lost rank
        if self.workers is not None:
            time.sleep(0.5)  # let the watchdog see which rank went away
        reason = self.workers.failure if self.workers is not None and self.workers.failure else None
        raise WorkerDiedError(reason or f"a tensor-parallel rank went away during the step: {exc}") from exc

    def stop(self, failed: bool = False) -> None:
        """Tell the other ranks to stop (unless one died or this rank ``failed``), join the
        spawned ones (terminating stragglers), leave the group."""
        if self.tp.rank != 0 or (not self.tp.is_parallel and self.workers is None):
            return
        channel, self.channel = self.channel, None
        if channel is not None and not failed and (self.workers is None or self.workers.failure is None):
            try:
                channel.send(("stop",))
            except Exception:  # a rank already gone
                logger.debug("telling the ranks to stop failed", exc_info=True)
        if self.workers is not None:
            self.workers.stop(timeout=2.0 if failed or self.workers.failure else 10.0)
            self.workers = None
        leave_group()
