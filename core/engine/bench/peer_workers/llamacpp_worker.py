"""Runs a bench job on llama.cpp through llama-cpp-python's low-level bindings:
``python llamacpp_worker.py JOB.json RESULT.json``.

The model is the GGUF the bench wrote (``job["settings"]["gguf"]``). A request's prompt is
one ``llama_decode`` (in chunks of ``n_batch``) with logits for its last token only; every
later token is one ``llama_decode`` of the previous token; tokens are chosen by llama.cpp's
greedy sampler (``llama_sampler_init_greedy``) and stamped with ``time.perf_counter()`` once
sampled. EOS means nothing here: each request decodes exactly its stated length.

- one after another (W1): one sequence (``n_seq_max`` 1); the KV cache is cleared before
  each request.
- all at once (W2): ``n_seq_max`` = the number of requests, one KV stream per sequence
  (``kv_unified`` false, so a sequence attends over its own cells only). Each prompt is
  prefilled in its own ``llama_decode``, in order; then each step is one ``llama_batch`` of
  one token for every unfinished sequence, each under its own ``seq_id``.

The context holds the longest request (prompt + output, warm-up included) per sequence;
``n_threads`` is the job's ``threads``; ``use_extra_bufts`` (weights repacked for llama.cpp's
fastest CPU kernels) is on unless ``job["settings"]["extra_buffer_types"]`` is false. One
untimed warm-up request runs first.
"""

from __future__ import annotations

import sys
import time
from typing import Any

try:
    from . import _protocol
except ImportError:  # run by path: _protocol is beside this file, on sys.path[0]
    import _protocol  # type: ignore[no-redef]

PEER = "llamacpp"
CTX_PAD = 256  # llama.cpp rounds each sequence's context up to a multiple of this
UBATCH = 512


def context_sizes(job: dict[str, Any]) -> dict[str, int]:
    """n_seq_max, n_ctx (per sequence times sequences), n_batch and n_ubatch for the job."""
    requests = [job["warmup"], *job["requests"]]
    longest = max(len(r["prompt_token_ids"]) + r["output_len"] for r in requests)
    n_seq = len(job["requests"]) if job["submission"] == _protocol.ALL_AT_ONCE else 1
    per_sequence = -(-longest // CTX_PAD) * CTX_PAD
    n_batch = max(max(len(r["prompt_token_ids"]) for r in requests), n_seq)
    return {"n_seq_max": n_seq, "n_ctx": n_seq * per_sequence, "n_batch": n_batch, "n_ubatch": min(UBATCH, n_batch)}


class Driver:
    """A llama.cpp model, one context sized for the job, one batch and a greedy sampler."""

    def __init__(self, job: dict[str, Any]) -> None:
        import llama_cpp as ll

        self.ll = ll
        self.sizes = context_sizes(job)
        self.gguf = job["settings"]["gguf"]
        ll.llama_backend_init()
        model_params = ll.llama_model_default_params()
        model_params.n_gpu_layers = 0
        # weights repacked into llama.cpp's extra CPU buffer types (its fastest kernels) unless the
        # bench turned them off (process_peers.LlamaCppPeer: a crash in them)
        self.use_extra_bufts = bool(job["settings"].get("extra_buffer_types", True))
        model_params.use_extra_bufts = self.use_extra_bufts
        self.model = ll.llama_model_load_from_file(self.gguf.encode(), model_params)
        if not self.model:
            raise RuntimeError(f"{PEER}: llama.cpp could not load {self.gguf} (its log above says why).")
        params = ll.llama_context_default_params()
        params.n_ctx = self.sizes["n_ctx"]
        params.n_batch = self.sizes["n_batch"]
        params.n_ubatch = self.sizes["n_ubatch"]
        params.n_seq_max = self.sizes["n_seq_max"]
        params.n_threads = params.n_threads_batch = job["threads"]
        params.kv_unified = False
        params.no_perf = True
        self.flash_attn_type = params.flash_attn_type
        self.ctx = ll.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError(f"{PEER}: llama.cpp could not create a context with {self.sizes}.")
        self.batch = ll.llama_batch_init(self.sizes["n_batch"], 0, 1)
        self.sampler = ll.llama_sampler_init_greedy()

    def close(self) -> None:
        ll = self.ll
        ll.llama_sampler_free(self.sampler)
        ll.llama_batch_free(self.batch)
        ll.llama_free(self.ctx)
        ll.llama_model_free(self.model)
        ll.llama_backend_free()

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of ``(token, position, seq_id, wants logits)`` entries."""
        batch = self.batch
        for i, (token, position, seq, logits) in enumerate(entries):
            batch.token[i] = token
            batch.pos[i] = position
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = logits
        batch.n_tokens = len(entries)
        status = self.ll.llama_decode(self.ctx, batch)
        if status != 0:
            raise RuntimeError(f"{PEER}: llama_decode returned {status} for a batch of {len(entries)} tokens.")

    def _prefill(self, prompt: list[int], seq: int) -> int:
        """The prompt of sequence ``seq`` from position 0; returns its first sampled token."""
        step = self.sizes["n_batch"]
        for start in range(0, len(prompt), step):
            chunk = prompt[start : start + step]
            last = start + len(chunk) == len(prompt)
            self._decode([(t, start + j, seq, last and j == len(chunk) - 1) for j, t in enumerate(chunk)])
        return self.ll.llama_sampler_sample(self.sampler, self.ctx, -1)

    def _clear(self) -> None:
        self.ll.llama_memory_clear(self.ll.llama_get_memory(self.ctx), True)

    def run(self, requests: list[dict[str, Any]], submission: str) -> dict[str, Any]:
        clocks = [_protocol.RequestClock() for _ in requests]
        self._clear()
        if submission == _protocol.ALL_AT_ONCE:
            start = time.perf_counter()
            for clock in clocks:
                clock.submitted = start
            self._all_at_once(requests, clocks)
        else:
            start = time.perf_counter()
            for request, clock in zip(requests, clocks):
                self._clear()
                clock.submit()
                self._one(request, clock)
        wall = time.perf_counter() - start
        _protocol.check_lengths(clocks, requests, PEER)
        return _protocol.run_record(wall, clocks)

    def _one(self, request: dict[str, Any], clock: _protocol.RequestClock) -> None:
        prompt = request["prompt_token_ids"]
        token = self._prefill(prompt, 0)
        clock.tokens(1, time.perf_counter())
        for position in range(len(prompt), len(prompt) + request["output_len"] - 1):
            self._decode([(token, position, 0, True)])
            token = self.ll.llama_sampler_sample(self.sampler, self.ctx, 0)
            clock.tokens(1, time.perf_counter())

    def _all_at_once(self, requests: list[dict[str, Any]], clocks: list[_protocol.RequestClock]) -> None:
        tokens, positions = [], []
        for seq, request in enumerate(requests):
            tokens.append(self._prefill(request["prompt_token_ids"], seq))
            positions.append(len(request["prompt_token_ids"]))
            clocks[seq].tokens(1, time.perf_counter())
        active = [seq for seq, r in enumerate(requests) if r["output_len"] > 1]
        while active:
            self._decode([(tokens[seq], positions[seq], seq, True) for seq in active])
            for j, seq in enumerate(active):
                tokens[seq] = self.ll.llama_sampler_sample(self.sampler, self.ctx, j)
                positions[seq] += 1
            now = time.perf_counter()
            for seq in active:
                clocks[seq].tokens(1, now)
            active = [seq for seq in active if len(clocks[seq].token_times) < requests[seq]["output_len"]]

    def describe(self) -> tuple[dict[str, Any], dict[str, Any]]:
        import llama_cpp

        ll = self.ll
        info = ll.llama_print_system_info().decode(errors="replace")
        # "CPU : SSE3 = 1 | AVX = 1 | ... | " -> the features set to 1
        parts = [part.split(":")[-1].split("=") for part in info.split("|")]
        features = sorted(p[0].strip() for p in parts if len(p) == 2 and p[1].strip() == "1")
        versions = {"llama_cpp_python": llama_cpp.__version__, "python": sys.version.split()[0]}
        settings = {
            "gguf": self.gguf,
            "n_ctx": ll.llama_n_ctx(self.ctx),
            "n_ctx_seq": ll.llama_n_ctx_seq(self.ctx),
            "n_batch": ll.llama_n_batch(self.ctx),
            "n_ubatch": ll.llama_n_ubatch(self.ctx),
            "n_seq_max": ll.llama_n_seq_max(self.ctx),
            "n_threads": ll.llama_n_threads(self.ctx),
            "kv_unified": False,
            "use_extra_bufts": self.use_extra_bufts,
            "flash_attn_type": {-1: "auto", 0: "off", 1: "on"}.get(self.flash_attn_type, self.flash_attn_type),
            "cpu_features": features,
        }
        return versions, settings


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(f"usage: {argv[0]} JOB.json RESULT.json", file=sys.stderr)
        return 2
    job = _protocol.read_job(argv[1])
    if not isinstance(job["settings"].get("gguf"), str):
        raise _protocol.ProtocolError("job.settings.gguf: expected the path of the GGUF to load.")
    driver = Driver(job)
    try:
        driver.run([job["warmup"]], _protocol.SEQUENTIAL)
        runs = [driver.run(job["requests"], job["submission"]) for _ in range(job["repeat"])]
        versions, settings = driver.describe()
    finally:
        driver.close()
    _protocol.write_result(argv[2], versions, settings, runs)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
