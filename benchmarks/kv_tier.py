"""KV tier figures on llama58m (bf16): restoring a prefix from a tier against recomputing it,
and the tier's store throughput against ``dd`` writing the same bytes to the same filesystem.

    python benchmarks/kv_tier.py --kv-tier disk --kv-tier-config '{"path": "/tmp/kv", "capacity_gb": 4}'
    python benchmarks/kv_tier.py --kv-tier cpu

Restore: one 2048-token prompt (plus one token) is computed from scratch (time to first
token, the median of --repeat runs, each with a fresh random prompt), then its blocks are
evicted from the primary cache into the tier and the same prompt runs again: its prefix
comes back from the tier and only the last token is computed (--cold: from the disk itself,
the page cache dropped first). Store throughput: the tier stores N distinct blocks (the futures all resolved)
over N * block bytes; ``dd bs=<block bytes> count=N`` copies the same bytes, from a file in
RAM (``/dev/shm``), into one file in the tier's directory (no sync inside either; both start
after a sync).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv-tier", default="disk")
    parser.add_argument(
        "--kv-tier-config", default=None, help="JSON; default for disk: a temporary directory, removed at the end"
    )
    parser.add_argument("--prefix-tokens", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--store-blocks", type=int, default=2048)
    parser.add_argument(
        "--cold",
        action="store_true",
        help="drop the page cache before each restore (root only), so blocks come from the disk",
    )
    args = parser.parse_args()

    import torch

    from engine.config import EngineConfig
    from engine.runtime.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    config = json.loads(args.kv_tier_config) if args.kv_tier_config else {}
    own_directory = args.kv_tier == "disk" and "path" not in config  # removed at the end: GiBs of blocks
    if own_directory:
        config["path"] = tempfile.mkdtemp(prefix="engine-kv-bench-")
    engine = LLMEngine(
        EngineConfig(
            model="llama58m", dtype="bfloat16", max_model_len=4096, kv_tier=args.kv_tier, kv_tier_config=config
        ),
        progress=False,
    )
    connector = engine.kv_tier
    rng = random.Random(11)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def ttft(prompt: list[int]) -> float:
        start = time.perf_counter()
        engine.add_request(f"r{time.perf_counter_ns()}", prompt, params)
        while engine.has_unfinished():
            engine.step()
        return time.perf_counter() - start

    recompute, restore = [], []
    for _ in range(args.repeat):
        prompt = [rng.randrange(32000) for _ in range(args.prefix_tokens + 1)]
        engine.reset_prefix_cache()
        recompute.append(ttft(prompt))
        connector.offload_cached()
        time.sleep(1.0)  # let a background writer finish: the restore below must read, not wait
        if args.cold:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
        before = connector.stats.prefetched_blocks
        restore.append(ttft(prompt))
        loaded = connector.stats.prefetched_blocks - before
        assert loaded == args.prefix_tokens // engine.config.block_size, f"only {loaded} blocks came from the tier"
    spec = connector.spec
    print(
        f"tier {args.kv_tier} {json.dumps(config)}; block {spec.block_bytes} bytes ({engine.config.block_size} tokens)"
    )
    r, c = statistics.median(restore), statistics.median(recompute)
    print(
        f"{args.prefix_tokens}-token prefix: recompute {c * 1e3:.1f} ms, restore from tier {r * 1e3:.1f} ms "
        f"-> {c / r:.1f}x (medians of {args.repeat}; runs recompute {[round(x * 1e3, 1) for x in recompute]}, "
        f"restore {[round(x * 1e3, 1) for x in restore]})"
    )

    # store throughput: the tier storing N fresh blocks, and dd writing the same bytes (medians of --repeat)
    n = args.store_blocks
    blocks = torch.randn(n, spec.block_numel).to(getattr(torch, spec.dtype))
    nbytes = n * spec.block_bytes
    tier_seconds, dd_seconds = [], []
    for _ in range(args.repeat):
        keys = [os.urandom(16) for _ in range(n)]
        os.sync()  # both runs start with no dirty pages waiting: neither pays for the other's writeback
        start = time.perf_counter()
        futures = [connector.tier.store(keys[i : i + 64], list(blocks[i : i + 64])) for i in range(0, n, 64)]
        ok = sum(sum(f.result()) for f in futures)
        tier_seconds.append(time.perf_counter() - start)
        assert ok == n, f"only {ok} of {n} blocks stored"
        if "path" in config:
            # dd copies the very bytes the tier stored, from a file in RAM (tmpfs), as the tier
            # copies them from the engine's memory
            source = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else config["path"], "kv-bench.src")
            with open(source, "wb") as f:
                f.write(blocks.view(torch.uint8).numpy().tobytes())
            target = os.path.join(config["path"], "dd.bench")
            os.sync()
            start = time.perf_counter()
            subprocess.run(
                ["dd", f"if={source}", f"of={target}", f"bs={spec.block_bytes}", f"count={n}"],
                check=True,
                capture_output=True,
            )
            dd_seconds.append(time.perf_counter() - start)
            os.remove(target)
            os.remove(source)
    t = statistics.median(tier_seconds)
    print(
        f"store: {n} blocks, {nbytes / 2**20:.0f} MiB: {nbytes / t / 2**20:.0f} MiB/s "
        f"(runs {[round(nbytes / x / 2**20) for x in tier_seconds]})"
    )
    if dd_seconds:
        d = statistics.median(dd_seconds)
        print(
            f"dd: {nbytes / d / 2**20:.0f} MiB/s (runs {[round(nbytes / x / 2**20) for x in dd_seconds]}); "
            f"tier/dd = {d / t:.2f}"
        )
    engine.close()
    if own_directory:
        shutil.rmtree(config["path"])


if __name__ == "__main__":
    main()
