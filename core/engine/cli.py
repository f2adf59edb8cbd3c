"""The ``engine`` command. Heavy modules are imported inside the subcommands, so
``engine --help`` and ``engine plugins`` never import torch."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Any, Sequence

from engine.version import PLUGIN_API_VERSION, __version__

DEFAULT_MODEL = "llama58m"
SERVE_MODEL = "demo"


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def _add_plugins_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--plugins",
        default=None,
        help="Comma-separated plugins to load (entry-point names or module paths); "
        "'' loads none; unset: $ENGINE_PLUGINS, else every installed plugin.",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="engine",
        description="An LLM inference engine with a thin core and plugins.",
        formatter_class=_Formatter,
    )
    parser.add_argument("--version", action="version", version=f"engine {__version__} (plugin API {PLUGIN_API_VERSION})")
    parser.add_argument("--log-level", default="WARNING", help="Logging level.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    plugins = sub.add_parser(
        "plugins", help="List installed plugins, their hooks and components.", formatter_class=_Formatter
    )
    _add_plugins_option(plugins)
    plugins.add_argument("--json", action="store_true", help="Print JSON instead of text.")
    plugins.add_argument("--probe", action="store_true", help="Also probe each platform's availability (imports torch).")

    generate = sub.add_parser("generate", help="Generate text for prompts, offline.", formatter_class=_Formatter)
    generate.add_argument(
        "model", nargs="?", default=DEFAULT_MODEL,
        help="Checkpoint directory, built-in model name or Hub id.",
    )
    _add_plugins_option(generate)
    generate.add_argument("--prompt", action="append", default=None, help="A text prompt (repeatable).")
    generate.add_argument(
        "--prompt-ids", action="append", default=None,
        help="A prompt as comma-separated token ids (repeatable). Default when the model has no tokenizer: 1,2,...,16.",
    )
    generate.add_argument("--max-tokens", type=int, default=32, help="Output tokens per prompt at most.")
    generate.add_argument("--temperature", type=float, default=0.0, help="0 is greedy.")
    generate.add_argument("--top-k", type=int, default=0, help="0 disables.")
    generate.add_argument("--top-p", type=float, default=1.0, help="1 disables.")
    generate.add_argument("--seed", type=int, default=None, help="Per-request sampling seed.")
    generate.add_argument("--ignore-eos", action="store_true", help="Do not stop at the model's EOS token.")
    generate.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                          help="Compute dtype; auto: the checkpoint's, where the platform supports it.")
    generate.add_argument("--device", default=None, help="Platform name; default: the only accelerator, else cpu.")
    generate.add_argument("--attention-backend", default=None, help="Backend name or module.path:Class.")
    generate.add_argument("--max-model-len", type=int, default=None, help="Default: from config.json.")
    generate.add_argument("--kv-cache-memory", type=float, default=None, help="KV-cache GiB; default: half of free memory.")
    generate.add_argument("--tensor-parallel-size", type=int, default=1, help="Ranks to split the model over: spawned here, or started by torchrun (one process per rank).")
    _add_kv_tier_options(generate)
    _add_quantization_options(generate)
    _add_speculative_options(generate)
    generate.add_argument("--json", action="store_true", help="Print JSON.")

    serve = sub.add_parser(
        "serve", help="Serve a model over an OpenAI-compatible HTTP API.", formatter_class=_Formatter,
        description="Serve MODEL over HTTP: /v1/completions, /v1/chat/completions, /v1/messages (Anthropic shape), "
        "/v1/models, /health, /metrics. With no MODEL, serves the built-in demo model.",
    )
    serve.add_argument("model", nargs="?", default=SERVE_MODEL,
                       help="Checkpoint directory, built-in model name or Hub id.")
    _add_plugins_option(serve)
    serve.add_argument("--host", default="127.0.0.1", help="Address to listen on; 0.0.0.0 exposes it to the network.")
    serve.add_argument("--port", type=int, default=8000, help="TCP port.")
    serve.add_argument("--api-key", default=None,
                       help="Key required on every endpoint but /health; default: $ENGINE_API_KEY, else none.")
    serve.add_argument("--served-model-name", default=None, help="Model name clients send; default: MODEL.")
    serve.add_argument("--metrics-public", action="store_true", help="Serve /metrics without the API key.")
    serve.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                          help="Compute dtype; auto: the checkpoint's, where the platform supports it.")
    serve.add_argument("--device", default=None, help="Platform name; default: the only accelerator, else cpu.")
    serve.add_argument("--attention-backend", default=None, help="Backend name or module.path:Class.")
    serve.add_argument("--max-model-len", type=int, default=None, help="Longest prompt + output; default: config.json.")
    serve.add_argument("--max-num-seqs", type=int, default=256, help="Most requests running at once.")
    serve.add_argument("--max-num-batched-tokens", type=int, default=16384, help="Token budget of one step.")
    serve.add_argument("--kv-cache-memory", type=float, default=None,
                       help="KV-cache GiB; default: the platform's (cpu: half of free memory, at most 4 GiB).")
    serve.add_argument("--block-size", type=int, default=16, help="Tokens per KV-cache block.")
    serve.add_argument("--no-prefix-caching", action="store_true", help="Turn prefix caching off.")
    _add_kv_tier_options(serve)
    _add_quantization_options(serve)
    _add_speculative_options(serve)
    serve.add_argument("--seed", type=int, default=0, help="Seed for unseeded sampling.")
    serve.add_argument("--tensor-parallel-size", type=int, default=1, help="Ranks to split the model over: spawned here, or started by torchrun (one process per rank).")

    bench = sub.add_parser(
        "bench", help="Run a benchmark workload (see benchmarks/README.md).", formatter_class=_Formatter,
        description="Run a fixed workload on the engine and, with --peers, on peers with the same weights and "
        "requests, in this process; prints each figure, the ratio engine/peer and how it was measured.\n\n"
        "  latency     W1: 1 request, prompt 128, 128 output tokens\n"
        "  throughput  W2: 64 requests of random lengths, all at once; and engine overhead at 64 decoding sequences\n"
        "  prefix      W3: 32 requests sharing a 1024-token prefix, one after another",
    )
    bench.add_argument("workload", choices=["latency", "throughput", "prefix"], help="Which workload to run.")
    bench.add_argument("--model", default=DEFAULT_MODEL, help="Checkpoint directory, built-in model name or Hub id.")
    _add_plugins_option(bench)
    bench.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                       help="Compute dtype of the engine and the peers.")
    _add_quantization_options(bench)
    _add_speculative_options(bench)
    bench.add_argument("--peers", default="", help="Comma-separated peers to run as well: hf (transformers generate).")
    bench.add_argument("--max-num-seqs", type=int, default=None, help="Engine limit; unset: the engine's default.")
    bench.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="Engine limit; unset: the engine's default."
    )
    bench.add_argument(
        "--scale", type=float, default=1.0,
        help="Multiply every request count and length by this (smoke tests); 1 is the WORKLOADS.md workload.",
    )
    bench.add_argument(
        "--repeat", type=int, default=1,
        help="Run the workload this many times on each runner and report each runner's run of median wall time "
        "(for machines whose speed drifts between runs).",
    )
    bench.add_argument("--json", action="store_true", help="Print JSON instead of a table.")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    log_format = "%(levelname)s %(name)s: %(message)s"
    if args.command == "serve":  # a long-running service: timestamped lines
        log_format = "%(asctime)s " + log_format
    logging.basicConfig(level=args.log_level.upper(), format=log_format)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        if args.command == "plugins":
            return cmd_plugins(args)
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "bench":
            return cmd_bench(args)
        if args.command == "serve":
            return cmd_serve(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # user-facing: one clear line, no traceback unless debugging
        if logging.getLogger().isEnabledFor(logging.DEBUG):
            raise
        print(f"engine {args.command}: error: {exc}", file=sys.stderr)
        return 1
    parser.error(f"unknown command {args.command!r}")
    return 2


def cmd_plugins(args: argparse.Namespace) -> int:
    import warnings

    from engine.plugins.components import KINDS
    from engine.plugins.manager import PluginLoadWarning, get_plugin_manager

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PluginLoadWarning)  # reported below instead
        pm = get_plugin_manager(args.plugins)
    components = pm.components()
    report: dict[str, Any] = {
        "engine": __version__,
        "plugin_api": PLUGIN_API_VERSION,
        "plugins": [info.as_dict() for info in pm.plugin_infos],
        "components": {
            kind.attr: [
                {"name": e.name, "target": e.target_repr, "plugin": e.plugin, "distribution": e.distribution}
                for e in components.registry(kind.attr).entries()
            ]
            for kind in KINDS
        },
    }
    if args.probe:
        report["platforms"] = _probe_platforms(components)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    if not pm.plugin_infos:
        print("No plugins loaded.")
    for info in pm.plugin_infos:
        where = f"{info.distribution} {info.version}" if info.distribution else f"module {info.module}"
        status = "loaded" if info.loaded else "FAILED"
        print(f"{info.name}  ({where}, {info.source}) {status}")
        if info.error:
            print(f"  error: {info.error}")
        if info.hooks:
            print(f"  hooks: {', '.join(info.hooks)}")
        for kind, names in info.components.items():
            if names:
                print(f"  {kind}: {', '.join(names)}")
    built_in = {kind: [e["name"] for e in entries if e["plugin"] == "engine"]
                for kind, entries in report["components"].items()}
    if any(built_in.values()):
        print("built into the engine:")
        for kind, names in built_in.items():
            if names:
                print(f"  {kind}: {', '.join(names)}")
    for probe in report.get("platforms", []):
        state = "available" if probe["available"] else "not available"
        print(f"platform {probe['name']}: {state} ({probe['reason']})")
    return 0


def _probe_platforms(components: Any) -> list[dict[str, Any]]:
    results = []
    for name in components.platforms.names():
        try:
            availability = components.platforms.get(name).is_available()
            results.append({"name": name, "available": availability.available, "reason": availability.reason})
        except Exception as exc:
            results.append({"name": name, "available": False, "reason": f"probe failed: {type(exc).__name__}: {exc}"})
    return results


def _run_as_worker(engine_config: Any) -> bool:
    """Under torchrun, ranks other than 0 serve rank 0's steps instead of the command;
    True once such a rank is done."""
    from engine.distributed.executor import run_worker, torchrun_launch

    launch = torchrun_launch()
    if launch is None or launch.rank == 0:
        return False
    run_worker(engine_config, launch)
    return True


def cmd_generate(args: argparse.Namespace) -> int:
    from engine.config import EngineConfig
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    config = EngineConfig(
        model=args.model, plugins=args.plugins, dtype=args.dtype, device=args.device,
        attention_backend=args.attention_backend, max_model_len=args.max_model_len,
        kv_cache_memory=args.kv_cache_memory, kv_tier=args.kv_tier, kv_tier_config=args.kv_tier_config,
        quantization=args.quantization, quantization_config=args.quantization_config,
        tensor_parallel_size=args.tensor_parallel_size, **_speculative_settings(args),
    )
    if _run_as_worker(config):  # every rank builds its engine from the same settings
        return 0
    llm = LLM.from_config(config)
    prompts: list[Any] = list(args.prompt or [])
    for ids in args.prompt_ids or []:
        prompts.append([int(t) for t in ids.split(",") if t.strip()])
    if not prompts:
        prompts = ["The capital of France is"] if llm.get_tokenizer() is not None else [list(range(1, 17))]
    params = SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
        max_tokens=args.max_tokens, ignore_eos=args.ignore_eos,
    )
    start = time.perf_counter()
    with llm:  # under tensor parallelism, closing stops the other ranks
        outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    if args.json:
        print(json.dumps([
            {"prompt": o.prompt, "prompt_token_ids": o.prompt_token_ids, "text": o.outputs[0].text,
             "token_ids": o.outputs[0].token_ids, "finish_reason": o.outputs[0].finish_reason}
            for o in outputs
        ], indent=2))
        return 0
    engine = llm.engine
    print(f"model {engine.model_path} ({engine.architecture}) on {engine.platform.name}, {engine.dtype_name}")
    for o in outputs:
        shown_prompt = o.prompt if o.prompt is not None else o.prompt_token_ids
        print(f"\nprompt: {shown_prompt!r}")
        if llm.get_tokenizer() is not None:
            print(f"output: {o.outputs[0].text!r}")
        print(f"output ids: {o.outputs[0].token_ids} (finish: {o.outputs[0].finish_reason})")
    print(f"\n{num_out} tokens in {elapsed:.2f} s ({num_out / max(elapsed, 1e-9):.1f} tokens/s)")
    return 0


def _add_kv_tier_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kv-tier", default=None,
        help="Secondary KV tier for evicted prefix blocks: cpu (built in), a plugin's tier (e.g. disk) or "
        "module.path:Class. Default: none.",
    )
    parser.add_argument(
        "--kv-tier-config", default=None,
        help='The tier\'s settings as a JSON object, e.g. \'{"capacity_gb": 8}\' (cpu) or '
        '\'{"path": "/var/cache/engine-kv", "capacity_gb": 20}\' (disk).',
    )


def _add_quantization_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quantization", default=None,
        help="Quantize an unquantized checkpoint while loading: a registered method (e.g. bitsandbytes, from "
        "engine-bitsandbytes) or module.path:Class. A quantized checkpoint needs no option: its config.json names "
        "its method.",
    )
    parser.add_argument(
        "--quantization-config", default=None,
        help='Settings for --quantization as a JSON object shaped like a checkpoint\'s quantization_config, e.g. '
        '\'{"load_in_8bit": true}\' or \'{"bnb_4bit_quant_type": "fp4"}\' (bitsandbytes).',
    )


def _add_speculative_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--speculative-method", default=None,
        help="Speculative decoding: a proposer drafts tokens, the model verifies them in one pass (outputs are "
        "unchanged). ngram (prompt lookup), draft (a small model, see --speculative-config), a plugin's proposer "
        "or module.path:Class. Default: none.",
    )
    parser.add_argument("--num-speculative-tokens", type=int, default=4,
                        help="Most draft tokens per request and step (fewer when acceptance or load says so).")
    parser.add_argument(
        "--speculative-config", default=None,
        help='The proposer\'s settings as a JSON object, e.g. \'{"model": "./draft-model"}\' (draft) or '
        '\'{"prompt_lookup_min": 2, "prompt_lookup_max": 5}\' (ngram).',
    )


def _speculative_settings(args: argparse.Namespace) -> dict[str, Any]:
    return {"speculative_method": args.speculative_method, "num_speculative_tokens": args.num_speculative_tokens,
            "speculative_config": args.speculative_config}


def cmd_serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from engine.config import EngineConfig, ServerConfig
    from engine.entrypoints.serve import serve

    try:
        engine_config = EngineConfig(
            model=args.model, plugins=args.plugins, dtype=args.dtype, device=args.device,
            attention_backend=args.attention_backend, max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            kv_cache_memory=args.kv_cache_memory, block_size=args.block_size,
            enable_prefix_caching=not args.no_prefix_caching, kv_tier=args.kv_tier,
            kv_tier_config=args.kv_tier_config, quantization=args.quantization,
            quantization_config=args.quantization_config, seed=args.seed,
            tensor_parallel_size=args.tensor_parallel_size, **_speculative_settings(args),
        )
        server_config = ServerConfig(
            host=args.host, port=args.port, api_key=args.api_key, served_model_name=args.served_model_name,
            metrics_public=args.metrics_public,
        )
    except ValidationError as exc:
        raise ValueError(_config_errors(exc)) from None
    logging.getLogger("engine").setLevel(min(logging.INFO, logging.getLogger().getEffectiveLevel()))
    if _run_as_worker(engine_config):
        return 0
    return serve(engine_config, server_config,
                 log_level="warning" if args.log_level.upper() == "WARNING" else args.log_level)


def _config_errors(exc: Any) -> str:
    """A pydantic error as option names: '--max-num-seqs: Input should be greater than or equal to 1'."""
    parts = []
    for error in exc.errors():
        name = "--" + "-".join(str(p) for p in error["loc"]).replace("_", "-")
        parts.append(f"{name}: {error['msg']}")
    return "; ".join(parts)


def cmd_bench(args: argparse.Namespace) -> int:
    from engine.bench.commands import BenchOptions, run_bench

    options = BenchOptions(
        model=args.model, plugins=args.plugins, dtype=args.dtype,
        peers=tuple(p.strip() for p in args.peers.split(",") if p.strip()),
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens, scale=args.scale,
        repeat=args.repeat, quantization=args.quantization, quantization_config=args.quantization_config,
        speculative_method=args.speculative_method, num_speculative_tokens=args.num_speculative_tokens,
        speculative_config=args.speculative_config,
    )
    report = run_bench(args.workload, options)
    print(report.as_json() if args.json else report.as_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
