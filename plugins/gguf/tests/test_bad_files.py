"""GGUF files the engine cannot load fail at start, before any weight is read, naming the file
and what is wrong: another architecture, a truncated or corrupt file, a tensor type the engine
has no conversion for."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from engine import LLM
from engine.model_loader.gguf import gguf_config


def write(path, arch: str, tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType | None]]):
    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_block_count(1)
    writer.add_embedding_length(32)
    for name, (data, kind) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


EMBEDDING = {"token_embd.weight": (np.zeros((64, 32), np.float32), None)}


def start(path) -> None:
    LLM(str(path), plugins=["cpu", "llama", "gguf"], dtype="float32", progress=False)


def test_an_unsupported_architecture_is_named(tmp_path):
    path = write(tmp_path / "falcon.gguf", "falcon", EMBEDDING)
    with pytest.raises(
        ValueError, match=r"GGUF architecture 'falcon' is not supported; supported: llama, qwen2, qwen3"
    ):
        start(path)


def test_a_truncated_file_is_named(tmp_path):
    whole = write(tmp_path / "whole.gguf", "llama", EMBEDDING)
    data = whole.read_bytes()
    for size in (len(data) - 100, 24):  # inside the tensor data, inside the metadata
        cut = tmp_path / f"cut-{size}.gguf"
        cut.write_bytes(data[:size])
        with pytest.raises(ValueError, match=rf"{cut} is truncated: it needs bytes up to \d+, the file has {size}\."):
            start(cut)


def test_a_file_of_another_format_is_named(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(ValueError, match=rf"{path} is not a GGUF file: it starts with b'PK\\x03\\x04'"):
        start(path)


def test_an_unsupported_tensor_type_is_named(tmp_path):
    q2_k = np.zeros((32, 84), np.uint8)  # 32 rows of one 256-input Q2_K block (84 bytes)
    tensors = {**EMBEDDING, "blk.0.attn_q.weight": (q2_k, gguf.GGMLQuantizationType.Q2_K)}
    path = write(tmp_path / "q2k.gguf", "llama", tensors)
    with pytest.raises(ValueError, match=r"tensor 'blk.0.attn_q.weight' is of GGML type Q2_K.*supported: F32, F16"):
        start(path)
    with pytest.raises(ValueError, match="Q2_K"):
        gguf_config(path)


def test_a_file_is_parsed_once_while_it_stays_the_same(tmp_path, monkeypatch):
    """The config, the weights and the bench share one parse of a file; a file written again
    (another size or time) is parsed again, and so is one whose damage came after a parse."""
    from engine.model_loader import gguf as loader

    parsed = []
    real = loader.GgufFile.__init__

    def counting(self, path):
        parsed.append(path)
        real(self, path)

    monkeypatch.setattr(loader.GgufFile, "__init__", counting)
    path = write(tmp_path / "m.gguf", "llama", EMBEDDING)
    first = loader.open_gguf(path)
    assert loader.open_gguf(str(path)) is first and len(parsed) == 1
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # truncated after the parse: found by the next one
    with pytest.raises(ValueError, match="truncated"):
        loader.open_gguf(path)
    assert len(parsed) == 2
