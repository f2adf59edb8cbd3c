"""GGUF checkpoints: one ``.gguf`` file holding a model's config (metadata), its tokenizer
and its tensors, as llama.cpp writes them.

- **Config**: ``general.architecture`` ``llama`` (Llama and Mistral), ``qwen2`` or ``qwen3``
  and its ``<arch>.*`` keys become the HF ``config.json`` of ``LlamaForCausalLM``,
  ``Qwen2ForCausalLM`` or ``Qwen3ForCausalLM`` (:func:`gguf_config`); a file without
  ``output.weight`` ties the output head to the token embedding. When any tensor is
  quantized, ``quantization_config`` is ``{"quant_method": "gguf", ...}``, which the
  ``gguf`` quantizer (engine-gguf) serves.
- **Tensors** (:func:`gguf_tensors`): llama.cpp's names (``blk.N.attn_q.weight``) become HF
  names (``model.layers.N.self_attn.q_proj.weight``); the q and k projections of ``llama``
  files have their rows put back from GGML's rope order (neighbouring pairs) into HF's
  (two halves). Quantized tensors are their raw blocks, uint8 [rows, bytes a row]: rows are
  whole outputs, so reordering rows moves whole blocks. Every 2-D tensor carries its GGML type
  (:data:`TYPE_TENSOR` in the layer, see :mod:`engine.layers.quantized_checkpoint`): a linear
  method that loads ``weight`` and ``ggml_type`` takes the tensor as it is; any other place
  gets it dequantized (``gguf.quants``, exact in float32).
- **Tokenizer**: transformers builds it from the metadata
  (``AutoTokenizer.from_pretrained(folder, gguf_file=name)``, see :mod:`engine.tokenizer`).

Reading needs the ``gguf`` package (engine-gguf depends on it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from engine.layers.quantized_checkpoint import QUANTIZED_ATTR, QuantizedCheckpoint

MAGIC = b"GGUF"
# GGUF general.architecture -> HF architecture
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
DENSE_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# block types the gguf quantizer converts (engine_gguf.blocks)
QUANTIZED_TYPES = ("Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K")
TYPE_TENSOR = "ggml_type"  # the name a linear layer loads a tensor's GGML type under
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
SKIPPED_TENSORS = ("rope_freqs.weight",)  # llama.cpp's rope factors, read into the config


def _require_gguf() -> Any:
    try:
        import gguf
    except ImportError:
        raise RuntimeError(
            "Loading a .gguf checkpoint needs the gguf package: install engine-gguf "
            "(pip install engine-gguf), which brings it and the quantizer for GGUF's blocks."
        ) from None
    return gguf


class _Truncated(Exception):
    def __init__(self, end: int, size: int) -> None:
        self.end, self.size = end, size


def _reader_class(gguf: Any) -> type:
    """``gguf.GGUFReader`` that says when a read runs past the end of the file (the reader itself
    fails later, on the short array, with numpy's words)."""

    class Reader(gguf.GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            end = int(offset) + int(np.empty([], dtype=dtype).itemsize) * int(count)
            if end > len(self.data):
                raise _Truncated(end, len(self.data))
            return super()._get(offset, dtype, count, override_order)

    return Reader


class GgufFile:
    """An opened GGUF file: its metadata and tensor table, checked for truncation and for
    tensor types the engine does not load. Errors name the file and what is wrong."""

    def __init__(self, path: str | Path) -> None:
        gguf = _require_gguf()
        self.path = Path(path)
        with open(self.path, "rb") as f:
            magic = f.read(4)
        if magic != MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file: it starts with {magic!r}, not {MAGIC!r}.")
        try:
            # copy-on-write: tensors are views of the mapped file that writing never reaches
            self.reader = _reader_class(gguf)(str(self.path), "c")
        except _Truncated as exc:
            raise ValueError(
                f"{self.path} is truncated: it needs bytes up to {exc.end}, the file has {exc.size}. "
                f"Download or write it again."
            ) from None
        except Exception as exc:  # the reader raises whatever numpy or struct raise on bad bytes
            raise ValueError(
                f"{self.path} is not a readable GGUF file ({type(exc).__name__}: {exc}); it may be "
                f"truncated or corrupt: download or write it again."
            ) from None
        size = self.path.stat().st_size
        self.tensors = {t.name: t for t in self.reader.tensors}
        for tensor in self.reader.tensors:
            end = int(tensor.data_offset) + int(tensor.n_bytes)
            if end > size or tensor.data.nbytes != int(tensor.n_bytes):
                raise ValueError(
                    f"{self.path} is truncated: tensor {tensor.name!r} ends at byte {end}, the file has "
                    f"{size} bytes. Download or write it again."
                )
        for tensor in self.reader.tensors:
            kind = tensor.tensor_type.name
            if kind not in DENSE_TYPES and kind not in QUANTIZED_TYPES:
                raise ValueError(
                    f"{self.path}: tensor {tensor.name!r} is of GGML type {kind}, which the engine does not "
                    f"load (supported: {', '.join([*DENSE_TYPES, *QUANTIZED_TYPES])}). Use a file quantized "
                    f"to one of those."
                )

    def value(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        value = self.value(key)
        if value is None:
            raise ValueError(f"{self.path} lacks the metadata key {key!r}, which a GGUF model needs.")
        return value

    @property
    def architecture(self) -> str:
        arch = self.require("general.architecture")
        if arch not in ARCHITECTURES:
            raise ValueError(
                f"GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)} ({self.path})."
            )
        return arch

    def tensor_type(self, name: str) -> str:
        return self.tensors[name].tensor_type.name


def gguf_config(path: str | Path) -> dict[str, Any]:
    """The HF ``config.json`` of the GGUF model at ``path`` (see the module docstring)."""
    return _config(GgufFile(path))


def _config(file: GgufFile) -> dict[str, Any]:
    arch = file.architecture
    splits = file.value("split.count", 1)
    if splits > 1:
        raise ValueError(
            f"{file.path} is part 1 of a GGUF split in {splits} files; merge them into one "
            f"(llama-gguf-split --merge) and load that."
        )
    if "token_embd.weight" not in file.tensors:
        raise ValueError(f"{file.path} has no token_embd.weight tensor.")
    hidden_size = int(file.require(f"{arch}.embedding_length"))
    num_heads = int(file.require(f"{arch}.attention.head_count"))
    vocab_size = int(file.tensors["token_embd.weight"].shape[1])  # GGUF shapes list the inputs first
    head_dim = int(file.value(f"{arch}.attention.key_length") or hidden_size // num_heads)
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden_size,
        "intermediate_size": int(file.require(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(file.require(f"{arch}.block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(file.value(f"{arch}.attention.head_count_kv") or num_heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(file.value(f"{arch}.context_length") or 2048),
        "rms_norm_eps": _float32(file.value(f"{arch}.attention.layer_norm_rms_epsilon") or 1e-6),
        "rope_theta": _float32(file.value(f"{arch}.rope.freq_base") or 10000.0),
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in file.tensors,
        "bos_token_id": file.value("tokenizer.ggml.bos_token_id"),
        "eos_token_id": _eos_token_ids(file),
    }
    if arch == "qwen2":
        config["attention_bias"] = "blk.0.attn_q.bias" in file.tensors
    rotary_dim = int(file.value(f"{arch}.rope.dimension_count") or head_dim)
    rope_scaling = _rope_scaling(file, arch, rotary_dim, config["rope_theta"])
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    types = {file.tensor_type(name) for name in file.tensors if len(file.tensors[name].shape) == 2}
    quantized = sorted(types & set(QUANTIZED_TYPES))
    if quantized:
        output = file.tensor_type("output.weight") if "output.weight" in file.tensors else None
        config["quantization_config"] = {
            "quant_method": "gguf",
            "types": quantized,
            "output_quantized": output in QUANTIZED_TYPES,
        }
    else:
        dense = [kind for kind in ("BF16", "F16", "F32") if kind in types]
        if dense:
            config["torch_dtype"] = str(DENSE_TYPES[dense[0]]).removeprefix("torch.")
    return config


def _eos_token_ids(file: GgufFile) -> int | list[int] | None:
    """The EOS token, with the end-of-turn and end-of-message tokens llama.cpp also stops at
    (Llama 3 instruct files: ``<|eot_id|>``, ``<|eom_id|>``)."""
    ids = [file.value(f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")]
    ids = list(dict.fromkeys(int(i) for i in ids if i is not None))
    return None if not ids else ids[0] if len(ids) == 1 else ids


def _float32(value: float) -> float:
    """A float32 metadata value as the shortest decimal that is it (1e-06, not 9.99999997e-07)."""
    return float(str(np.float32(value)))


# Llama 3.1's rope scaling, which llama.cpp stores as a rope_freqs tensor; its factor is read
# from the tensor, these are checked against it
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def llama3_rope_factors(rotary_dim: int, theta: float, factor: float, low: float, high: float, old: int):
    """llama.cpp's ``rope_freqs`` for Llama 3.1's rope scaling (``convert_hf_to_gguf.py``): what
    each frequency's wavelength is multiplied by."""
    freqs = 1.0 / theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    wavelen = 2 * np.pi / freqs
    smooth = (old / wavelen - low) / (high - low)
    middle = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, factor, middle)).astype(np.float32)


def _rope_scaling(file: GgufFile, arch: str, rotary_dim: int, theta: float) -> dict[str, Any] | None:
    kind = file.value(f"{arch}.rope.scaling.type")
    if "rope_freqs.weight" in file.tensors:
        factors = np.asarray(file.tensors["rope_freqs.weight"].data, dtype=np.float32)
        llama3 = {"rope_type": "llama3", "factor": float(factors.max()), **LLAMA3_ROPE}
        expected = llama3_rope_factors(
            rotary_dim,
            theta,
            llama3["factor"],
            LLAMA3_ROPE["low_freq_factor"],
            LLAMA3_ROPE["high_freq_factor"],
            LLAMA3_ROPE["original_max_position_embeddings"],
        )
        if factors.shape != expected.shape or not np.allclose(factors, expected, rtol=1e-4):
            raise ValueError(
                f"{file.path} scales its rope by a rope_freqs tensor that is not Llama 3.1's rope scaling "
                f"(factor {llama3['factor']}, low/high frequency factors 1 and 4, 8192 original positions); "
                f"load the model's safetensors checkpoint instead."
            )
        return llama3
    if kind in (None, "none"):
        return None
    factor = float(file.require(f"{arch}.rope.scaling.factor"))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        original = int(file.require(f"{arch}.rope.scaling.original_context_length"))
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
    raise ValueError(f"{file.path}: rope scaling {kind!r} is not supported (supported: linear, yarn, llama3).")


class GgufDequantizer:
    """Makes a GGUF tensor dense (float32) for a place that holds dense values: what a kept
    tensor's :class:`QuantizedCheckpoint` calls."""

    def __init__(self) -> None:
        self.dequantized = 0

    def dequantize(self, name: str, weight: torch.Tensor, ggml_type: torch.Tensor) -> torch.Tensor:
        gguf = _require_gguf()
        kind = gguf.GGMLQuantizationType(int(ggml_type))
        if kind.name in DENSE_TYPES:
            return weight.float()
        values = gguf.quants.dequantize(weight.contiguous().numpy(), kind)
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


def hf_name(name: str) -> str | None:
    """The HF name of a llama.cpp tensor name, None for one that is read into the config; a
    ValueError for one with no place in the model."""
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    if name in SKIPPED_TENSORS:
        return None
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdecimal() and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise ValueError(f"GGUF tensor {name!r} has no place in the model.")


def unpermute_from_ggml_rope(rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rows of a q or k projection (weight or bias; ``num_heads`` heads) from GGML's rope order,
    pairs ``(2j, 2j + 1)``, back to HF's, pairs ``(j, j + head_dim/2)``: the inverse of
    ``convert_hf_to_gguf.py``'s permutation."""
    n = rows.shape[0]
    return rows.reshape(num_heads, n // num_heads // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def gguf_tensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """``(HF name, tensor)`` for every tensor of the GGUF at ``path`` (see the module docstring)."""
    file = GgufFile(path)
    config = _config(file)
    dequantizer = GgufDequantizer()
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    for tensor in file.reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            continue
        kind = tensor.tensor_type
        data = torch.from_numpy(tensor.data)
        if kind.name == "BF16":
            data = data.view(torch.bfloat16)
        module = name.split(".")[-2]
        if file.architecture == "llama" and module in heads:
            data = unpermute_from_ggml_rope(data, heads[module])
        if data.dim() == 2:
            kept = QuantizedCheckpoint(tensor.name, "weight", TYPE_TENSOR, torch.tensor(int(kind)), dequantizer)
            setattr(data, QUANTIZED_ATTR, kept)
        yield name, data
