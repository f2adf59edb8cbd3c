"""The commands' options come from EngineConfig and ServerConfig: every field has a flag
whose help shows the field's description and its true default, and a flag given on the
command line reaches the config the command builds."""

from __future__ import annotations

import argparse
import re
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from engine.cli import BENCH_ENGINE_FIELDS, DEFAULT_MODEL, SERVE_MODEL, bench_options, build_parser, main
from engine.config import EngineConfig, ServerConfig
from engine.config_cli import add_config_options, config_from_namespace


def help_entries(capsys, monkeypatch, command: str) -> dict[str, str]:
    """``engine COMMAND --help`` as {each option string or positional name: its whole entry}."""
    monkeypatch.setenv("COLUMNS", "10000")  # no wrapping inside a help text
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    entries: dict[str, str] = {}
    lines = capsys.readouterr().out.splitlines()
    for i, line in enumerate(lines):
        if not re.match(r"^  \S", line):
            continue
        text = line
        for more in lines[i + 1 :]:
            if not re.match(r"^ {3,}\S", more):
                break
            text += " " + more.strip()
        invocation = re.split(r"\s{2,}", line.strip())[0]
        for name in re.findall(r"--[\w-]+|^\w+", invocation):
            entries[name] = " ".join(text.split())
    return entries


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def shown_default(config: BaseModel, name: str) -> str:
    value = getattr(config, name)
    if isinstance(value, list):  # --help writes a list as its comma-separated form
        value = ",".join(str(item) for item in value)
    return f"(default: {value})"


@pytest.mark.parametrize("command, model", [("generate", DEFAULT_MODEL), ("serve", SERVE_MODEL)])
def test_help_lists_every_engine_field_with_its_description_and_default(capsys, monkeypatch, command, model):
    entries = help_entries(capsys, monkeypatch, command)
    defaults = EngineConfig(model=model)  # what the engine really uses when nothing is given
    for name, field in EngineConfig.model_fields.items():
        entry = entries.get("model" if name == "model" else flag(name))
        assert entry is not None, f"engine {command} --help has no {flag(name)}"
        assert f"{field.description} {shown_default(defaults, name)}" in entry, entry


def test_serve_help_lists_every_server_field(capsys, monkeypatch):
    entries = help_entries(capsys, monkeypatch, "serve")
    defaults = ServerConfig()
    for name, field in ServerConfig.model_fields.items():
        assert f"{field.description} {shown_default(defaults, name)}" in entries[flag(name)]


def test_bench_help_derives_its_engine_options(capsys, monkeypatch):
    entries = help_entries(capsys, monkeypatch, "bench")
    defaults = EngineConfig(model=DEFAULT_MODEL)
    for name in set(BENCH_ENGINE_FIELDS) - {"dtype"}:
        assert f"{EngineConfig.model_fields[name].description} {shown_default(defaults, name)}" in entries[flag(name)]
    assert "Compute dtype of the engine and the peers. (default: bfloat16)" in entries["--dtype"]
    assert "--workload" not in entries and "--peers" in entries


def test_prefix_caching_keeps_its_short_spelling(capsys, monkeypatch):
    entry = help_entries(capsys, monkeypatch, "serve")["--no-prefix-caching"]
    assert entry.startswith(
        "--enable-prefix-caching, --no-enable-prefix-caching, --prefix-caching, --no-prefix-caching"
    )


# -------------------------------------------------------------------------
# the parse path: argv -> namespace -> config
# -------------------------------------------------------------------------


def engine_config(*argv: str) -> EngineConfig:
    return config_from_namespace(EngineConfig, build_parser().parse_args(list(argv)))


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_unset_options_keep_the_config_defaults(command):
    model = DEFAULT_MODEL if command == "generate" else SERVE_MODEL
    assert engine_config(command) == EngineConfig(model=model)
    assert engine_config(command, "./ckpt").model == "./ckpt"


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_flags_of_each_type_reach_the_engine_config(command):
    config = engine_config(
        command,
        "./ckpt",
        "--block-size",
        "8",
        "--max-num-seqs",
        "3",  # int
        "--kv-cache-memory",
        "0.25",
        "--kv-cache-memory-fraction",
        "0.5",  # float | None
        "--max-model-len",
        "96",
        "--tokenizer",
        "./tok",  # int | None, str | None
        "--dtype",
        "float16",  # Literal
        "--no-prefix-caching",  # bool
        "--kv-tier",
        "cpu",
        "--kv-tier-config",
        '{"capacity_gb": 2}',  # dict as JSON
        "--plugins",
        "cpu, llama",  # list[str] as a comma-separated string
        "--seed",
        "7",
        "--tensor-parallel-size",
        "2",
    )
    assert config == EngineConfig(
        model="./ckpt",
        block_size=8,
        max_num_seqs=3,
        kv_cache_memory=0.25,
        kv_cache_memory_fraction=0.5,
        max_model_len=96,
        tokenizer="./tok",
        dtype="float16",
        enable_prefix_caching=False,
        kv_tier="cpu",
        kv_tier_config={"capacity_gb": 2},
        plugins=["cpu", "llama"],
        seed=7,
        tensor_parallel_size=2,
    )


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--no-prefix-caching"], False),
        (["--no-enable-prefix-caching"], False),
        (["--prefix-caching"], True),
        (["--no-prefix-caching", "--enable-prefix-caching"], True),
    ],
)
def test_prefix_caching_spellings(argv, expected):
    assert engine_config("generate", *argv).enable_prefix_caching is expected


def test_empty_plugins_loads_none():
    assert engine_config("serve", "--plugins", "").plugins == []


def test_serve_flags_reach_the_server_config():
    args = build_parser().parse_args(["serve", "--port", "0", "--metrics-public", "--max-request-bytes", "4096"])
    assert config_from_namespace(ServerConfig, args) == ServerConfig(
        port=0, metrics_public=True, max_request_bytes=4096
    )
    assert config_from_namespace(EngineConfig, args) == EngineConfig(model=SERVE_MODEL)


def test_bad_values_name_the_options():
    with pytest.raises(ValueError) as exc_info:
        engine_config("generate", "--max-num-seqs", "0", "--kv-cache-memory-fraction", "2")
    assert str(exc_info.value) == (
        "--max-num-seqs: Input should be greater than or equal to 1; "
        "--kv-cache-memory-fraction: Input should be less than or equal to 1"
    )
    with pytest.raises(ValueError, match="^--speculative-config: Value error, speculative_config is not valid JSON"):
        engine_config("serve", "--speculative-config", "{nope")


def test_generate_reports_bad_options_in_one_line(capsys):
    assert main(["generate", "--block-size", "0"]) == 1
    assert capsys.readouterr().err.strip() == (
        "engine generate: error: --block-size: Input should be greater than or equal to 1"
    )


def test_bench_passes_only_the_engine_settings_given():
    args = build_parser().parse_args(
        [
            "bench",
            "throughput",
            "--max-num-seqs",
            "32",
            "--plugins",
            "cpu",
            "--quantization-config",
            '{"bits": 4}',
            "--peers",
            "hf",
        ]
    )
    options = bench_options(args)
    assert (options.model, options.dtype, options.peers) == (DEFAULT_MODEL, "bfloat16", ("hf",))
    assert dict(options.engine_settings) == {"max_num_seqs": 32, "plugins": "cpu", "quantization_config": '{"bits": 4}'}
    with pytest.raises(ValueError, match="^--num-speculative-tokens: Input should be less than or equal to 64$"):
        bench_options(build_parser().parse_args(["bench", "latency", "--num-speculative-tokens", "65"]))


# -------------------------------------------------------------------------
# the generator on a model of its own: a new field needs no CLI edit
# -------------------------------------------------------------------------


class Settings(BaseModel):
    count: int = Field(3, description="How many.")
    ratio: float | None = Field(None, description="A share, 100% at most.")
    mode: Literal["fast", "safe"] = Field("safe", description="Which way.")
    enable_async_scheduling: bool = Field(False, description="Overlap steps.")
    extra: dict[str, int] = Field(default_factory=dict, description="A JSON object.")


def test_a_new_field_gets_a_flag_with_its_type_default_and_help():
    parser = argparse.ArgumentParser()
    assert add_config_options(parser, Settings) == list(Settings.model_fields)
    actions = {a.dest: a for a in parser._actions}
    assert actions["count"].type is int and actions["ratio"].type is float
    assert actions["mode"].choices == ("fast", "safe")
    assert actions["count"].help == "How many. (default: 3)"
    assert parser.format_help().count("A share, 100% at most. (default: None)") == 1
    assert set(actions["enable_async_scheduling"].option_strings) == {
        "--enable-async-scheduling",
        "--no-enable-async-scheduling",
        "--async-scheduling",
        "--no-async-scheduling",
    }
    args = parser.parse_args(["--count", "5", "--mode", "fast", "--async-scheduling"])
    assert vars(args) == {"count": 5, "mode": "fast", "enable_async_scheduling": True}
    with pytest.raises(SystemExit):
        parser.parse_args(["--mode", "slow"])


def test_a_field_without_a_command_line_form_is_refused():
    class Odd(BaseModel):
        pair: tuple[int, int] = (1, 2)

    with pytest.raises(TypeError, match=r"Odd\.pair .* has no command-line form"):
        add_config_options(argparse.ArgumentParser(), Odd)
    with pytest.raises(ValueError, match="Odd has no field"):
        add_config_options(argparse.ArgumentParser(), Odd, only=["nope"])
