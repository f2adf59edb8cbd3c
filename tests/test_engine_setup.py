"""Every component is resolved and checked from the EngineConfig before any weight is read:
a mistake in the KV tier, the proposer, the quantizer or the attention backend fails in
well under a second with its own message, and no safetensors file is opened. Spawned
tensor-parallel ranks start from the engine's own module, so a script read from stdin works."""

from __future__ import annotations

import subprocess
import sys
import time
from contextlib import contextmanager

import pytest

from engine import LLM
from engine.interfaces.quantizer import Quantizer
from engine.plugins.registry import ComponentError
from engine.selection import SelectionError
from engine.testing.checkpoints import make_tiny_checkpoint

_opened: list[list[str]] = []  # the paths opened while a `watching_opens` block runs


def _audit(event: str, args: tuple) -> None:
    if event == "open" and _opened and isinstance(args[0], str | bytes):
        _opened[-1].append(str(args[0]))


sys.addaudithook(_audit)  # audit hooks cannot be removed: this one records only inside the block


@contextmanager
def watching_opens():
    paths: list[str] = []
    _opened.append(paths)
    try:
        yield paths
    finally:
        _opened.pop()


class CudaOnlyQuantizer(Quantizer):
    name = "cuda_only"
    supported_platforms = frozenset({"cuda"})

    @classmethod
    def from_config(cls, quantization_config, *, prequantized):
        return cls()

    def get_linear_method(self, layer_name):
        return None


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_tiny_checkpoint("LlamaForCausalLM", path)
    return path


MISTAKES = {
    "unknown tier": ({"kv_tier": "dsk"}, ComponentError, "Unknown KV tier 'dsk'"),
    "bad tier config": ({"kv_tier": "cpu", "kv_tier_config": {"capacity_gb": 1e-9}}, ValueError, "holds no block"),
    "unknown tier setting": ({"kv_tier": "cpu", "kv_tier_config": {"capacity": 1}}, ValueError, "capacity"),
    "unknown proposer": ({"speculative_method": "ngarm"}, ComponentError, "ngarm"),
    "quantizer refusing the platform": (
        {"quantization": f"{__name__}:CudaOnlyQuantizer"},
        SelectionError,
        "does not run on platform 'cpu'",
    ),
    "unknown attention backend": ({"attention_backend": "flash"}, ComponentError, "flash"),
    "an fp8 KV cache no backend here keeps": (
        {"kv_cache_dtype": "fp8"},
        SelectionError,
        r"KV-cache dtype fp8\): cpu_paged: KV-cache dtype fp8 not supported",
    ),
    "attention backend refusing the model": (
        {"attention_backend": "cpu_mla"},
        SelectionError,
        "Attention backend 'cpu_mla' cannot serve this model",
    ),
}


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_a_config_mistake_fails_before_any_weight_is_read(checkpoint, mistake):
    options, error, message = MISTAKES[mistake]
    LLM(str(checkpoint), plugins=["cpu", "llama"], dtype="float32", progress=False)  # imports warmed up
    started = time.monotonic()
    with watching_opens() as opened, pytest.raises(error, match=message):
        LLM(str(checkpoint), plugins=["cpu", "llama"], dtype="float32", progress=False, **options)
    assert time.monotonic() - started < 1.0
    assert not [path for path in opened if path.endswith(".safetensors")]


def test_the_watch_sees_the_weights_opened(checkpoint):
    """The check above can fail: building an engine does open the checkpoint."""
    with watching_opens() as opened:
        LLM(str(checkpoint), plugins=["cpu", "llama"], dtype="float32", progress=False)
    assert [path for path in opened if path.endswith(".safetensors")]


def test_two_ranks_from_a_script_on_stdin_give_the_output_of_one(checkpoint):
    script = (
        "from engine import LLM, SamplingParams\n"
        f"llm = LLM({str(checkpoint)!r}, plugins=['cpu', 'llama'], dtype='float32', progress=False,\n"
        "          kv_cache_memory=0.05, tensor_parallel_size=TP)\n"
        "out = llm.generate([[1, 2, 3, 4], [5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=8,\n"
        "                   ignore_eos=True), use_tqdm=False)\n"
        "print([o.outputs[0].token_ids for o in out])\n"
        "llm.close()\n"
    )
    results = []
    for tp in (1, 2):
        run = subprocess.run(
            [sys.executable, "-"], input=script.replace("TP", str(tp)), text=True, capture_output=True, timeout=300
        )
        assert run.returncode == 0, run.stderr[-2000:]
        results.append(run.stdout.strip().splitlines()[-1])
    assert results[0] == results[1] and results[0].startswith("[[")
