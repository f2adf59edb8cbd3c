"""Only safetensors weights are loaded, and no code shipped with a checkpoint runs."""

from __future__ import annotations

import json

import pytest

from engine.model_loader.checkpoint import safetensors_files
from engine.tokenizer import load_tokenizer


def test_pickle_weights_are_refused_with_a_hint(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(FileNotFoundError, match=r"pytorch_model\.bin: pickle checkpoints are not loaded"):
        safetensors_files(tmp_path)


def test_pickle_weights_are_ignored_next_to_safetensors(tiny_checkpoint):
    path, _ = tiny_checkpoint("LlamaForCausalLM")
    (path / "pytorch_model.bin").write_bytes(b"never opened")
    assert [f.name for f in safetensors_files(path)] == ["model.safetensors"]


def test_tokenizer_remote_code_never_runs(tmp_path):
    from engine.testing.checkpoints import make_tiny_tokenizer

    make_tiny_tokenizer(320).save_pretrained(tmp_path)
    marker = tmp_path / "remote_code_ran"
    (tmp_path / "evil_tokenizer.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import PreTrainedTokenizerFast\n"
        "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["auto_map"] = {"AutoTokenizer": [None, "evil_tokenizer.EvilTokenizer"]}
    config_path.write_text(json.dumps(config))
    try:
        tokenizer = load_tokenizer(tmp_path)
    except ValueError as exc:  # transformers refuses remote code when trust_remote_code is off
        assert "trust_remote_code" in str(exc)
    else:
        assert type(tokenizer).__name__ != "EvilTokenizer"
    assert not marker.exists()
