"""A GGUF of a Llama checkpoint for the llama.cpp peer, written with the ``gguf`` package.

The tensors are the checkpoint's, renamed to llama.cpp's names and cast to the bench dtype
(bf16 by default; the norms stay fp32, as ``convert_hf_to_gguf.py`` keeps 1-D tensors), with
the q and k projections permuted for GGML's rope as ``convert_hf_to_gguf.py`` does for Llama:
HF orders each head's rotary pairs as two halves, GGML's rope as neighbours.

The bench gives llama.cpp token ids, never text, so the vocabulary only has to load: a
SentencePiece-shaped list of ``vocab_size`` tokens (``<unk>``, the checkpoint's BOS and EOS,
the 256 byte tokens, then placeholders), all scores 0.

The file is cached beside the checkpoint directory, named by a hash of the checkpoint's
files (config and safetensors), the dtype and :data:`FORMAT_VERSION`.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

FORMAT_VERSION = 1  # bump when the file written changes, so that cached files are written anew
ARCHITECTURE = "llama"
GGUF_TYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
FILE_TYPES = {"bfloat16": "MOSTLY_BF16", "float16": "MOSTLY_F16", "float32": "ALL_F32"}

# HF Llama parameter name -> llama.cpp tensor name ({i}: the layer)
GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
BYTE_TOKENS = 256


def require_gguf() -> Any:
    try:
        import gguf
    except ImportError:
        raise RuntimeError(
            "The llamacpp peer writes its GGUF with the gguf package, which this Python lacks: "
            "pip install gguf (it is in engine's bench and test extras)."
        ) from None
    return gguf


def gguf_name(hf_name: str) -> str:
    """llama.cpp's name of an HF Llama parameter; a ValueError names one it has no place for."""
    if hf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf_name]
    parts = hf_name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdecimal() and parts[3] in LAYER_NAMES:
        return f"blk.{parts[2]}.{LAYER_NAMES[parts[3]]}"
    raise ValueError(f"The GGUF export knows no llama.cpp tensor for the checkpoint's {hf_name!r}.")


def permute_for_ggml_rope(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rows of a q or k projection (``num_heads`` heads of ``head_dim`` rows) reordered from
    HF's rotary layout (pairs ``(j, j + head_dim/2)``) to GGML's (pairs ``(2j, 2j + 1)``)."""
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"{rows} rows do not split into {num_heads} heads of an even size.")
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


@dataclass(frozen=True)
class LlamaShape:
    vocab_size: int
    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    context_length: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_id: int | None


def llama_shape(config: dict[str, Any]) -> LlamaShape:
    """The fields of a Llama ``config.json`` the GGUF needs; a ValueError for what it cannot express."""
    architectures = config.get("architectures") or []
    if config.get("model_type") != "llama" or architectures[:1] != ["LlamaForCausalLM"]:
        raise ValueError(
            f"The llamacpp peer converts LlamaForCausalLM checkpoints only; this one is "
            f"{architectures or config.get('model_type')}."
        )
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag):
            raise ValueError(f"The GGUF export does not write biases ({flag} is true).")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"The GGUF export writes plain rope only; the checkpoint's rope_type is {rope_type!r}.")
    num_heads = int(config["num_attention_heads"])
    hidden_size = int(config["hidden_size"])

    def token_id(key: str) -> int | None:
        value = config.get(key)
        return value[0] if isinstance(value, list) else value

    return LlamaShape(
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden_size,
        num_layers=int(config["num_hidden_layers"]),
        intermediate_size=int(config["intermediate_size"]),
        num_heads=num_heads,
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        head_dim=int(config.get("head_dim") or hidden_size // num_heads),
        context_length=int(config.get("max_position_embeddings", 4096)),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        bos_token_id=token_id("bos_token_id"),
        eos_token_id=token_id("eos_token_id"),
    )


def vocabulary(shape: LlamaShape) -> tuple[list[str], list[int]]:
    """``vocab_size`` distinct token strings and their GGUF token types: ``<unk>`` at 0, BOS and
    EOS where the config puts them (``<s>``/``</s>``, control), the 256 byte tokens ``<0xXX>``
    next when they fit, then ``<token_N>`` placeholders."""
    from gguf import TokenType

    n = shape.vocab_size
    tokens = [f"<token_{i}>" for i in range(n)]
    types = [int(TokenType.NORMAL)] * n
    special = {0: ("<unk>", TokenType.UNKNOWN)}
    for token_id, text in ((shape.bos_token_id, "<s>"), (shape.eos_token_id, "</s>")):
        if token_id is not None and 0 <= token_id < n and token_id not in special:
            special[token_id] = (text, TokenType.CONTROL)
    for token_id, (text, kind) in special.items():
        tokens[token_id], types[token_id] = text, int(kind)
    free = [i for i in range(n) if i not in special]
    if len(free) >= BYTE_TOKENS:
        for byte, token_id in zip(range(BYTE_TOKENS), free):
            tokens[token_id], types[token_id] = f"<0x{byte:02X}>", int(TokenType.BYTE)
    return tokens, types


def checkpoint_files(model_path: Path) -> list[Path]:
    files = sorted(model_path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"The GGUF export reads safetensors; {model_path} has none.")
    return files


def checkpoint_digest(model_path: str | Path, dtype: str) -> str:
    """sha256 over the format version, the dtype and the bytes of config.json and every
    ``*.safetensors`` file (by name, in order)."""
    model_path = Path(model_path)
    digest = hashlib.sha256(f"gguf-export {FORMAT_VERSION} {dtype}\n".encode())
    for path in [model_path / "config.json", *checkpoint_files(model_path)]:
        digest.update(f"{path.name} {path.stat().st_size}\n".encode())
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


def gguf_path(model_path: str | Path, dtype: str) -> Path:
    """Where the GGUF of ``model_path`` in ``dtype`` is cached: beside the checkpoint directory."""
    model_path = Path(model_path).resolve()
    key = checkpoint_digest(model_path, dtype)[:16]
    return model_path.parent / f"{model_path.name}.{key}.{GGUF_TYPES[dtype].lower()}.gguf"


def _tensors(model_path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for path in checkpoint_files(model_path):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _gguf_array(tensor: torch.Tensor, dtype: str) -> tuple[np.ndarray, Any]:
    """The tensor's values in the GGUF type for ``dtype`` (1-D tensors fp32), and that type."""
    from gguf import GGMLQuantizationType

    if tensor.dim() <= 1 or dtype == "float32":
        return tensor.to(torch.float32).numpy(), GGMLQuantizationType.F32
    if dtype == "float16":
        return tensor.to(torch.float16).numpy(), GGMLQuantizationType.F16
    # torch's round-to-nearest-even cast: the same bf16 values the engine and HF compute with
    bits = tensor.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return bits, GGMLQuantizationType.BF16


def write_gguf(model_path: str | Path, out: str | Path, dtype: str = "bfloat16") -> Path:
    """Write the GGUF of the Llama checkpoint at ``model_path`` to ``out``."""
    gguf = require_gguf()
    if dtype not in GGUF_TYPES:
        raise ValueError(f"The GGUF export writes {', '.join(GGUF_TYPES)}, not {dtype!r}.")
    model_path = Path(model_path)
    with open(model_path / "config.json", encoding="utf-8") as f:
        shape = llama_shape(json.load(f))

    writer = gguf.GGUFWriter(str(out), arch=ARCHITECTURE)
    writer.add_name(model_path.name)
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.hidden_size)
    writer.add_block_count(shape.num_layers)
    writer.add_feed_forward_length(shape.intermediate_size)
    writer.add_head_count(shape.num_heads)
    writer.add_head_count_kv(shape.num_kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_norm_eps)
    writer.add_vocab_size(shape.vocab_size)
    writer.add_file_type(int(getattr(gguf.LlamaFileType, FILE_TYPES[dtype])))

    tokens, types = vocabulary(shape)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    if shape.bos_token_id is not None and tokens[shape.bos_token_id] == "<s>":
        writer.add_bos_token_id(shape.bos_token_id)
    if shape.eos_token_id is not None and tokens[shape.eos_token_id] == "</s>":
        writer.add_eos_token_id(shape.eos_token_id)
    writer.add_add_bos_token(False)

    written = set()
    for name, tensor in _tensors(model_path):
        if name.endswith("rotary_emb.inv_freq"):
            continue
        target = gguf_name(name)
        if name.endswith("self_attn.q_proj.weight"):
            tensor = permute_for_ggml_rope(tensor, shape.num_heads)
        elif name.endswith("self_attn.k_proj.weight"):
            tensor = permute_for_ggml_rope(tensor, shape.num_kv_heads)
        data, kind = _gguf_array(tensor, dtype)
        writer.add_tensor(target, data, raw_dtype=kind)
        written.add(target)
    expected = {"token_embd.weight", "output_norm.weight"} | {
        f"blk.{i}.{suffix}" for i in range(shape.num_layers) for suffix in LAYER_NAMES.values()
    }
    if not shape.tie_word_embeddings:
        expected.add("output.weight")
    missing = sorted(expected - written)
    if missing:
        raise ValueError(f"The checkpoint at {model_path} lacks tensors llama.cpp needs: {', '.join(missing)}.")

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(out)


def cached_gguf(model_path: str | Path, dtype: str = "bfloat16") -> Path:
    """The GGUF of ``model_path`` in ``dtype``, written once beside the checkpoint (see :func:`gguf_path`)."""
    require_gguf()
    if dtype not in GGUF_TYPES:
        raise ValueError(f"The GGUF export writes {', '.join(GGUF_TYPES)}, not {dtype!r}.")
    path = gguf_path(model_path, dtype)
    if not path.exists():
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        try:
            write_gguf(model_path, partial, dtype)
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)
    return path


def gguf_weight_bytes(path: str | Path) -> int:
    """Bytes of the GGUF's tensors that a decode step reads in full: all but the token
    embedding table, which is gathered (unless it is also the output, with no output.weight)."""
    gguf = require_gguf()
    reader = gguf.GGUFReader(str(path))
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    embedding = sizes.get("token_embd.weight", 0) if "output.weight" in sizes else 0
    return sum(sizes.values()) - embedding
