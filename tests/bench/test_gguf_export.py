"""The llamacpp peer's GGUF against the gguf package's own reader, on a tiny Llama checkpoint
with grouped-query attention (4 heads, 2 KV heads): every tensor's name, shape and values,
the q/k rows in GGML's rope order (the permutation written out plainly here), the metadata
llama.cpp reads for a Llama model and its vocabulary, and the cache beside the checkpoint."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf", reason="gguf is in engine's test extras")

from engine.bench.gguf_export import (  # noqa: E402
    cached_gguf,
    gguf_name,
    gguf_path,
    gguf_weight_bytes,
    llama_shape,
    permute_for_ggml_rope,
    write_gguf,
)
from engine.bench.process_peers import checkpoint_weight_bytes  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from engine.testing.checkpoints import make_tiny_checkpoint

    path = tmp_path_factory.mktemp("gguf") / "tiny-llama"
    model = make_tiny_checkpoint("LlamaForCausalLM", path)
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (NUM_HEADS, NUM_KV_HEADS)
    return path, {name: t.detach().clone() for name, t in model.state_dict().items()}


def ggml_rope_order(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """GGML's rope rotates neighbouring rows (2j, 2j + 1) of each head; HF's rotates (j, j + d/2).
    Row 2j + t of a head in the GGUF is row j + t * d/2 of that head in the checkpoint."""
    d = weight.shape[0] // num_heads
    rows = []
    for head in range(num_heads):
        for j in range(d // 2):
            for t in range(2):
                rows.append(head * d + j + t * (d // 2))
    return weight[rows]


def read(path):
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    fields = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    return tensors, fields


def values(tensor) -> np.ndarray:
    """A tensor's values as fp32, in numpy's (row-major) shape."""
    shape = tuple(int(n) for n in reversed(tensor.shape))
    if tensor.tensor_type == gguf.GGMLQuantizationType.BF16:
        return gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
    return np.asarray(tensor.data, dtype=np.float32).reshape(shape)


def test_the_permutation_is_ggmls_rope_order():
    weight = torch.randn(NUM_KV_HEADS * HEAD_DIM, 8)
    assert torch.equal(permute_for_ggml_rope(weight, NUM_KV_HEADS), ggml_rope_order(weight, NUM_KV_HEADS))
    with pytest.raises(ValueError, match="do not split into 3 heads"):
        permute_for_ggml_rope(weight, 3)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_every_tensor_reads_back_with_its_name_shape_and_values(checkpoint, tmp_path, dtype):
    path, state = checkpoint
    tensors, _ = read(write_gguf(path, tmp_path / "tiny.gguf", dtype))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    expected = {}
    for name, weight in state.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        target = gguf_name(name)
        assert target == names.get_name(name.removesuffix(".weight")) + ".weight"  # the gguf package's own mapping
        if name.endswith("q_proj.weight"):
            weight = ggml_rope_order(weight, NUM_HEADS)
        elif name.endswith("k_proj.weight"):
            weight = ggml_rope_order(weight, NUM_KV_HEADS)
        expected[target] = weight
    assert set(tensors) == set(expected)
    for target, weight in expected.items():
        tensor = tensors[target]
        assert [int(n) for n in reversed(tensor.shape)] == list(weight.shape), target
        if weight.dim() == 1 or dtype == "float32":
            assert tensor.tensor_type == gguf.GGMLQuantizationType.F32, target
            want = weight.float().numpy()
        else:
            assert tensor.tensor_type == gguf.GGMLQuantizationType.BF16, target
            want = weight.to(torch.bfloat16).float().numpy()  # the engine's and HF's bf16 values
        np.testing.assert_array_equal(values(tensor), want, err_msg=target)


def test_q_and_k_are_not_left_in_hf_order(checkpoint, tmp_path):
    path, state = checkpoint
    tensors, _ = read(write_gguf(path, tmp_path / "tiny.gguf", "float32"))
    for hf, target in (("q_proj", "attn_q"), ("k_proj", "attn_k")):
        assert not np.array_equal(
            values(tensors[f"blk.0.{target}.weight"]), state[f"model.layers.0.self_attn.{hf}.weight"]
        )
    v = values(tensors["blk.0.attn_v.weight"])
    np.testing.assert_array_equal(v, state["model.layers.0.self_attn.v_proj.weight"].numpy())


def test_metadata_is_what_llama_cpp_reads_for_a_llama_model(checkpoint, tmp_path):
    path, _ = checkpoint
    config = json.loads((path / "config.json").read_text())
    _, fields = read(write_gguf(path, tmp_path / "tiny.gguf", "bfloat16"))
    assert fields["general.architecture"] == "llama"
    assert fields["general.file_type"] == gguf.LlamaFileType.MOSTLY_BF16
    assert fields["llama.block_count"] == config["num_hidden_layers"]
    assert fields["llama.context_length"] == config["max_position_embeddings"]
    assert fields["llama.embedding_length"] == config["hidden_size"]
    assert fields["llama.feed_forward_length"] == config["intermediate_size"]
    assert fields["llama.attention.head_count"] == NUM_HEADS
    assert fields["llama.attention.head_count_kv"] == NUM_KV_HEADS
    assert fields["llama.attention.key_length"] == fields["llama.attention.value_length"] == HEAD_DIM
    assert fields["llama.rope.dimension_count"] == HEAD_DIM
    assert fields["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or {}
    assert fields["llama.rope.freq_base"] == pytest.approx(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    vocab = config["vocab_size"]
    assert fields["llama.vocab_size"] == vocab
    # a SentencePiece-shaped vocabulary of exactly vocab_size distinct tokens, with the byte tokens
    # llama.cpp looks up (its newline token is <0x0A>)
    tokens, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    assert fields["tokenizer.ggml.model"] == "llama"
    assert len(tokens) == len(set(tokens)) == len(types) == len(fields["tokenizer.ggml.scores"]) == vocab
    assert tokens[0] == "<unk>" and types[0] == gguf.TokenType.UNKNOWN
    assert fields["tokenizer.ggml.unknown_token_id"] == 0
    for key, text in (("bos", "<s>"), ("eos", "</s>")):
        token_id = fields[f"tokenizer.ggml.{key}_token_id"]
        assert token_id == config[f"{key}_token_id"] and tokens[token_id] == text
        assert types[token_id] == gguf.TokenType.CONTROL
    byte_tokens = [t for t, kind in zip(tokens, types) if kind == gguf.TokenType.BYTE]
    assert byte_tokens == [f"<0x{b:02X}>" for b in range(256)]


def test_weight_bytes_are_every_tensor_but_the_gathered_embedding(checkpoint, tmp_path):
    path, state = checkpoint
    f32 = write_gguf(path, tmp_path / "f32.gguf", "float32")
    assert gguf_weight_bytes(f32) == checkpoint_weight_bytes(path, "float32")
    read_in_full = [t for n, t in state.items() if not n.endswith("embed_tokens.weight")]
    bf16 = write_gguf(path, tmp_path / "bf16.gguf", "bfloat16")
    assert gguf_weight_bytes(bf16) == sum(t.numel() * (4 if t.dim() == 1 else 2) for t in read_in_full)


def test_the_gguf_is_cached_beside_the_checkpoint_by_its_content(checkpoint, tmp_path):
    source, _ = checkpoint
    path = tmp_path / "model"
    shutil.copytree(source, path)
    first = cached_gguf(path, "bfloat16")
    assert first.parent == tmp_path and first.name.startswith("model.") and first.name.endswith(".bf16.gguf")
    stamp = first.stat().st_mtime_ns
    assert cached_gguf(path, "bfloat16") == first and first.stat().st_mtime_ns == stamp  # not written again
    assert gguf_path(path, "float32") != first  # another dtype, another file
    config = json.loads((path / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5
    (path / "config.json").write_text(json.dumps(config))
    second = cached_gguf(path, "bfloat16")
    assert second != first and second.exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".partial")) == []


def test_checkpoints_the_export_cannot_express_are_refused():
    base = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4}
    base |= {"num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 320}
    assert llama_shape(base).head_dim == 16 and llama_shape(base).num_kv_heads == 4
    with pytest.raises(ValueError, match=r"LlamaForCausalLM checkpoints only; this one is \['MistralForCausalLM'\]"):
        llama_shape({**base, "architectures": ["MistralForCausalLM"]})
    with pytest.raises(ValueError, match="does not write biases \\(attention_bias is true\\)"):
        llama_shape({**base, "attention_bias": True})
    with pytest.raises(ValueError, match="rope_type is 'llama3'"):
        llama_shape({**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}})
    with pytest.raises(ValueError, match="no llama.cpp tensor for the checkpoint's 'model.layers.0.mlp.fc1.weight'"):
        gguf_name("model.layers.0.mlp.fc1.weight")


def test_k_quants_fall_back_where_rows_do_not_split_into_super_blocks():
    """A K-quant needs rows of whole 256-value super-blocks (llama58m's ffn_down has 1408 inputs):
    such a tensor is written in the 32-value type llama.cpp's quantizer falls back to, one the
    engine reads."""
    from engine.bench.gguf_export import fallback_type

    assert fallback_type("Q4_K", 512) == "Q4_K" and fallback_type("Q6_K", 1024) == "Q6_K"
    assert fallback_type("Q6_K", 1408) == "Q8_0"
    assert fallback_type("Q4_K", 1408) == "Q4_0" and fallback_type("Q5_K", 1408) == "Q8_0"
    assert fallback_type("Q8_0", 1408) == "Q8_0"
