"""The other tensor-parallel ranks: rank 0 spawns ranks 1..N-1 on this machine as
``python -m engine.engine.workers`` processes (never by re-importing the caller's main
module, so ``LLM(..., tensor_parallel_size=2)`` works from stdin, a notebook or an
unguarded script), a thread watches them, and each runs :func:`serve_steps` over its
:class:`~engine.engine.model_shard.ModelShard` until rank 0 says stop.

Every step rank 0 broadcasts the step's flat input arrays (``("forward", arrays)``), each
time it needs logits which rows of the step's hidden states they are for (``("logits",
rows)``: every rank has the same hidden states), and each time its KV tier moves blocks
which ones (``("kv_gather", blocks)``, ``("kv_write", blocks, rows)``: each rank gives or
takes its KV heads; ``("state_gather", row)``, ``("state_write", row, state)``: its part of a
recurrent-state snapshot), so that every rank runs the same collectives in the same order."""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from engine.config import EngineConfig
from engine.distributed.executor import ControlChannel, Launch, join_group, leave_group
from engine.engine.model_shard import ModelShard, build_shard
from engine.engine.setup import check_tensor_parallel, resolve_setup
from engine.plugins.manager import get_plugin_manager
from engine.runtime.model_runner import select_rows

logger = logging.getLogger("engine.distributed")

# set in the environment of every rank rank 0 spawns, to its rank
WORKER_RANK_ENV = "ENGINE_WORKER_RANK"


def run_worker(config: EngineConfig, launch: Launch) -> None:
    """Build rank ``launch.rank``'s shard of the engine and serve rank 0's steps."""
    setup = resolve_setup(config, get_plugin_manager(config.plugins).components())
    check_tensor_parallel(setup, launch)
    setup.platform.configure_process()
    setup.platform.seed_everything(config.seed)
    tp = join_group(launch, setup.platform.dist_backend)
    try:
        channel = ControlChannel(tp)
        serve_steps(build_shard(setup, tp=tp, channel=channel, progress=False), channel)
    finally:
        leave_group()


def serve_steps(shard: ModelShard, channel: ControlChannel) -> None:
    """A worker's loop: run each step rank 0 broadcasts until it says stop."""
    runner = shard.runner
    hidden = None
    while True:
        message = channel.receive()
        kind = message[0]
        if kind == "forward":
            hidden = runner.execute_arrays(message[1])
        elif kind == "logits":  # rows of this step's hidden states, the same on every rank
            runner.model.compute_logits(select_rows(hidden, message[1]))
        elif kind == "kv_gather":  # the KV tier on rank 0 stores blocks: this rank's heads of them
            channel.gather(shard.kv_blocks.local(message[1]))
        elif kind == "kv_write":  # ... or loads blocks: this rank takes its heads
            shard.kv_blocks.write(message[1], message[2])
        elif kind == "state_gather":  # ... stores a recurrent-state snapshot: this rank's part of it
            channel.gather(shard.kv_blocks.local_state(message[1]))
        elif kind == "state_write":  # ... or loads one: this rank takes its part
            shard.kv_blocks.write_state(message[1], message[2])
        elif kind == "stop":
            return
        else:
            raise RuntimeError(f"unknown step message {kind!r} from rank 0")


class LocalWorkers:
    """Ranks 1..N-1 spawned on this machine by rank 0, and a thread watching them."""

    def __init__(
        self, config: EngineConfig, world_size: int, init_method: str, on_death: Callable[[str], None]
    ) -> None:
        # the configuration, and this process's import path (plugins given as module paths import there too)
        payload = json.dumps({"config": config.model_dump(mode="json"), "sys_path": sys.path})
        self.processes: list[subprocess.Popen] = []
        for rank in range(1, world_size):
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "engine.engine.workers",
                    "--rank",
                    str(rank),
                    "--world-size",
                    str(world_size),
                    "--init-method",
                    init_method,
                ],
                stdin=subprocess.PIPE,
                text=True,
                env={**os.environ, WORKER_RANK_ENV: str(rank)},
            )
            process.name = f"engine-tp-rank-{rank}"  # type: ignore[attr-defined]
            process.stdin.write(payload)
            process.stdin.close()
            self.processes.append(process)
            logger.info("started %s (pid %d)", process.name, process.pid)  # type: ignore[attr-defined]
        self.stopping = threading.Event()
        self.failure: str | None = None
        self.on_death = on_death
        self.watchdog = threading.Thread(target=self._watch, name="engine-tp-watchdog", daemon=True)
        self.watchdog.start()

    def _watch(self) -> None:
        while not self.stopping.wait(0.1):
            for process in self.processes:
                if process.poll() is not None:
                    if self.stopping.is_set():
                        return
                    self.failure = (
                        f"tensor-parallel worker {process.name} (pid {process.pid}) exited with "
                        f"status {process.returncode}"
                    )
                    logger.error("%s; the engine cannot go on", self.failure)
                    self.on_death(self.failure)
                    return

    def stop(self, timeout: float = 10.0) -> None:
        self.stopping.set()
        deadline = time.monotonic() + timeout
        for process in self.processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(2.0)
                except subprocess.TimeoutExpired:
                    process.kill()


def main(argv: list[str] | None = None) -> int:
    """A spawned rank: its launch on the command line; rank 0's configuration and import
    path on stdin."""
    parser = argparse.ArgumentParser(prog="python -m engine.engine.workers")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--init-method", required=True)
    args = parser.parse_args(argv)
    launch = Launch(args.rank, args.world_size, args.init_method)
    logging.basicConfig(level=logging.WARNING, format=f"[rank {launch.rank}] %(levelname)s %(name)s: %(message)s")
    payload = json.loads(sys.stdin.read())
    sys.path[:] = payload["sys_path"]
    run_worker(EngineConfig.model_validate(payload["config"]), launch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
