"""The quantizer of a prequantized checkpoint is looked up by ``"<quant_method>/<format>"`` first
(the format its config_groups name), then by ``"<quant_method>"``: one method's formats served by
different plugins (compressed-tensors: float-quantized by engine-cuda, pack-quantized by
engine-compressed-tensors), formats the engine dequantizes still dequantized where no quantizer
for them runs, and groups of different formats refused."""

from __future__ import annotations

import json
import shutil

import pytest

from engine.config import EngineConfig
from engine.engine.setup import resolve_setup
from engine.model_loader.dequant import CheckpointDequantizer
from engine.plugins.manager import get_plugin_manager
from engine.selection import SelectionError
from engine.testing.checkpoints import make_tiny_checkpoint

PLUGINS = ["cpu", "llama", "cuda", "compressed_tensors"]


def group(fmt: str, **weights) -> dict:
    return {"format": fmt, "targets": ["Linear"], "weights": weights, "input_activations": None}


PACK = group("pack-quantized", num_bits=4, type="int", strategy="group", group_size=32, symmetric=True)
FLOAT = group("float-quantized", num_bits=8, type="float", strategy="channel", symmetric=True)
MXFP4 = group("mxfp4-pack-quantized", num_bits=4, type="float", strategy="group", group_size=32)
INT = group("int-quantized", num_bits=8, type="int", strategy="channel", symmetric=True)


def compressed_tensors(**groups) -> dict:
    return {"quant_method": "compressed-tensors", "config_groups": groups, "ignore": ["lm_head"]}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("formats") / "base"
    make_tiny_checkpoint("LlamaForCausalLM", path)
    return path


def setup_for(base, path, quantization_config: dict, plugins=PLUGINS, register=None):
    """The engine's setup of the checkpoint ``base`` with ``quantization_config`` in its config.json
    (no weight is read); ``register``: (name, class path) added to the quantizers first."""
    path.mkdir()
    shutil.copy(base / "generation_config.json", path)
    config_json = json.loads((base / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config_json, "quantization_config": quantization_config}))
    config = EngineConfig(model=str(path), plugins=plugins, dtype="float32")
    components = get_plugin_manager(plugins).components()
    if register is not None:
        components.quantizers.add(*register, plugin="local", distribution="local")
    return resolve_setup(config, components)


def test_pack_quantized_resolves_to_its_own_plugin(base, tmp_path):
    from engine_compressed_tensors.quantizer import PackQuantizedQuantizer

    setup = setup_for(base, tmp_path / "pack", compressed_tensors(group_0=PACK))
    assert type(setup.quantizer) is PackQuantizedQuantizer and setup.dequantizer is None
    # both plugins register a format of the method, so neither name collides
    names = setup.components.quantizers.names()
    assert {"compressed-tensors/float-quantized", "compressed-tensors/pack-quantized"} <= set(names)
    assert "compressed-tensors" not in names
    # the format named at the top only (no format in the groups) resolves the same way
    top = {**compressed_tensors(group_0={k: v for k, v in PACK.items() if k != "format"}), "format": "pack-quantized"}
    assert type(setup_for(base, tmp_path / "top", top).quantizer) is PackQuantizedQuantizer


def test_float_quantized_where_its_quantizer_does_not_run_is_dequantized_at_load(base, tmp_path, monkeypatch):
    """A platform outside the float-quantized quantizer's supported_platforms: the weights become dense."""
    from engine_cuda.fp8 import CompressedTensorsFp8Quantizer

    monkeypatch.setattr(CompressedTensorsFp8Quantizer, "supported_platforms", frozenset({"cuda"}))
    setup = setup_for(base, tmp_path / "float", compressed_tensors(group_0=FLOAT))
    assert setup.quantizer is None and isinstance(setup.dequantizer, CheckpointDequantizer)
    assert not setup.dequantizer.keep_quantized


def test_float_quantized_resolves_to_engine_cuda_where_it_runs(base, tmp_path):
    """engine-cuda's float-quantized quantizer runs on the CPU too (the platform's fp8_linear)."""
    from engine_cuda.fp8 import CompressedTensorsFp8Quantizer

    setup = setup_for(base, tmp_path / "float", compressed_tensors(group_0=FLOAT))
    assert type(setup.quantizer) is CompressedTensorsFp8Quantizer and setup.dequantizer.keep_quantized


def test_groups_of_different_formats_are_refused(base, tmp_path):
    with pytest.raises(SelectionError, match=r"mixes formats .*\(a: pack-quantized, b: int-quantized\).*same one"):
        setup_for(base, tmp_path / "mixed", compressed_tensors(a=PACK, b=INT))


def test_groups_of_formats_the_engine_dequantizes_are_dequantized(base, tmp_path):
    setup = setup_for(base, tmp_path / "mixed", compressed_tensors(a=FLOAT, b=MXFP4))
    assert setup.quantizer is None and isinstance(setup.dequantizer, CheckpointDequantizer)


def test_without_the_plugin_the_error_names_it(base, tmp_path):
    with pytest.raises(
        SelectionError,
        match=r"in format 'pack-quantized'.* no quantizer is registered as 'compressed-tensors/pack-quantized' or "
        r"'compressed-tensors' .*pip install engine-compressed-tensors",
    ):
        setup_for(base, tmp_path / "pack", compressed_tensors(group_0=PACK), plugins=["cpu", "llama", "cuda"])


def test_a_quantizer_of_the_whole_method_serves_formats_without_their_own(base, tmp_path):
    from engine_compressed_tensors.quantizer import PackQuantizedQuantizer

    register = ("compressed-tensors", "engine_compressed_tensors.quantizer:PackQuantizedQuantizer")
    setup = setup_for(base, tmp_path / "pack", compressed_tensors(group_0=PACK), ["cpu", "llama"], register)
    assert type(setup.quantizer) is PackQuantizedQuantizer
