"""GGUF checkpoints: one ``.gguf`` file holding a model's config (metadata), its tokenizer
and its tensors, as llama.cpp writes them.

- **Config**: ``general.architecture`` and its ``<arch>.*`` keys become the HF ``config.json``
  (:func:`gguf_config`): ``llama`` (Llama and Mistral; Mixtral when ``llama.expert_count`` is
  set), ``qwen2``, ``qwen3``, ``qwen3moe`` (experts in every layer, their top-k weights
  renormalised as llama.cpp does), ``phi3`` (partial rotary dimensions, LongRoPE from the
  ``rope_factors_long``/``rope_factors_short`` tensors, the sliding window) and ``gemma3`` (with
  ``attention.sliding_window`` every sixth layer global, the others local with rope base 10000
  or ``rope.freq_base_swa``; the rope scaling on the global layers; queries scaled as llama.cpp
  does). A file without ``output.weight`` ties the output head to the token embedding. When
  any tensor is quantized, ``quantization_config`` is ``{"quant_method": "gguf", ...}``, which
  the ``gguf`` quantizer (engine-gguf) serves.
- **Tensors** (:func:`gguf_tensors`): llama.cpp's names (``blk.N.attn_q.weight``) become HF
  names (``model.layers.N.self_attn.q_proj.weight``); the q and k projections of ``llama``
  files have their rows put back from GGML's rope order (neighbouring pairs) into HF's
  (two halves). A mixture of experts' stacked tensors (``blk.N.ffn_gate_exps.weight``,
  [experts, outputs, inputs]) become each expert's (``mlp.experts.E.gate_proj.weight``), the
  router ``ffn_gate_inp`` ``mlp.gate``; Phi-3's fused ``attn_qkv`` and ``ffn_up`` (gate then up)
  are split into their parts; Gemma 3's norms, which llama.cpp stores as ``1 + weight``, have
  the 1 taken off. Quantized tensors are their raw blocks, uint8 [rows, bytes a row]: rows are
  whole outputs, so reordering or splitting rows moves whole blocks. Every 2-D tensor carries its
  GGML type (:data:`TYPE_TENSOR` in the layer, see :mod:`engine.layers.quantized_checkpoint`): a
  linear method that loads ``weight`` and ``ggml_type`` (or a quantizer's experts method)
  takes the tensor as it is; any other place (the embedding; experts without such a method)
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
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",  # MixtralForCausalLM with llama.expert_count > 0
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
MODEL_TYPES = {"qwen3moe": "qwen3_moe", "gemma3": "gemma3_text"}
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
    "ffn_gate_inp": "mlp.gate",  # the router of a mixture of experts
}
# Gemma 3's norms around the attention and the MLP (its ffn_norm is the one before the MLP)
GEMMA3_LAYER_NAMES = LAYER_NAMES | {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# llama.cpp's Gemma 3: with a sliding window every sixth layer global, the others local with
# rope base 10000 (unless the file says otherwise), unscaled
GEMMA3_GLOBAL_EVERY = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0
GEMMA3_27B_LAYERS = 62  # llama.cpp scales the 27B model's queries by (hidden / heads) ** -0.5, not head_dim's
# a mixture of experts' stacked tensors [experts, outputs, inputs] -> each expert's projection
EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# llama.cpp's rope factors, read into the config
SKIPPED_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


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

    @property
    def hf_architecture(self) -> str:
        """The HF architecture: :data:`ARCHITECTURES`'s, Mixtral for a ``llama`` file with experts."""
        arch = self.architecture
        if arch == "llama" and int(self.value("llama.expert_count") or 0) > 0:
            return "MixtralForCausalLM"
        return ARCHITECTURES[arch]

    def tensor_type(self, name: str) -> str:
        return self.tensors[name].tensor_type.name


_OPENED: dict[tuple[str, int, int], GgufFile] = {}  # the last files opened, by path, size and mtime


def open_gguf(path: str | Path) -> GgufFile:
    """The :class:`GgufFile` at ``path``, parsed once while the file stays the same: the config,
    the weights and the bench all read it (a large vocabulary's metadata takes seconds)."""
    resolved = Path(path).resolve()
    stat = resolved.stat()
    key = (str(resolved), stat.st_size, stat.st_mtime_ns)
    file = _OPENED.get(key)
    if file is None:
        file = GgufFile(resolved)
        _OPENED.clear()  # one file at a time: a cached reader keeps its file mapped
        _OPENED[key] = file
    return file


def gguf_config(path: str | Path) -> dict[str, Any]:
    """The HF ``config.json`` of the GGUF model at ``path`` (see the module docstring)."""
    return _config(open_gguf(path))


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
    experts = int(file.value(f"{arch}.expert_count") or 0)
    # Qwen3-MoE files may leave out the dense MLP size their layers do not use
    intermediate = file.value(f"{arch}.feed_forward_length", file.value(f"{arch}.expert_feed_forward_length"))
    if intermediate is None:
        file.require(f"{arch}.feed_forward_length")
    config: dict[str, Any] = {
        "architectures": [file.hf_architecture],
        "model_type": MODEL_TYPES.get(arch, arch) if file.hf_architecture != "MixtralForCausalLM" else "mixtral",
        "hidden_size": hidden_size,
        "intermediate_size": int(intermediate),
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
    if experts:
        used = int(file.require(f"{arch}.expert_used_count"))
        config |= {"num_experts_per_tok": used}
        if arch == "qwen3moe":
            config |= {
                "num_experts": experts,
                "moe_intermediate_size": int(file.require(f"{arch}.expert_feed_forward_length")),
                # llama.cpp renormalises Qwen3-MoE's top-k weights unless the file says otherwise
                "norm_topk_prob": bool(file.value(f"{arch}.expert_weights_norm", True)),
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
            }
        else:
            config |= {"num_local_experts": experts, "sliding_window": None}
    elif arch == "qwen3moe":
        file.require(f"{arch}.expert_count")
    rotary_dim = int(file.value(f"{arch}.rope.dimension_count") or head_dim)
    if arch == "phi3":
        window = int(file.value(f"{arch}.attention.sliding_window") or 0)
        config |= {"sliding_window": window or None, "partial_rotary_factor": rotary_dim / head_dim}
        config["original_max_position_embeddings"] = int(
            file.value(f"{arch}.rope.scaling.original_context_length") or config["max_position_embeddings"]
        )
    rope_scaling = _rope_scaling(file, arch, rotary_dim, config["rope_theta"])
    if arch == "gemma3":
        config |= _gemma3_config(file, config, rope_scaling)
    elif rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    types = {file.tensor_type(name) for name in file.tensors if len(file.tensors[name].shape) >= 2}
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


def _gemma3_config(file: GgufFile, config: dict[str, Any], rope_scaling: dict[str, Any] | None) -> dict[str, Any]:
    """Gemma 3's fields as llama.cpp reads its file: local (sliding-window) layers but every
    sixth when ``attention.sliding_window`` is set, their own rope base, the rope scaling on the
    global layers only, the query scale and the final logit cap."""
    num_layers, window = config["num_hidden_layers"], int(file.value("gemma3.attention.sliding_window") or 0)
    types = [
        "sliding_attention" if window and (i + 1) % GEMMA3_GLOBAL_EVERY else "full_attention" for i in range(num_layers)
    ]
    full = {"rope_type": "default", "rope_theta": config["rope_theta"]} | (rope_scaling or {})
    local = {
        "rope_type": "default",
        "rope_theta": _float32(file.value("gemma3.rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE)),
    }
    scalar = (
        config["hidden_size"] // config["num_attention_heads"]
        if num_layers == GEMMA3_27B_LAYERS
        else config["head_dim"]
    )
    softcap = file.value("gemma3.final_logit_softcapping")
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "layer_types": types,
        "sliding_window": window or None,
        "rope_parameters": {"full_attention": full, "sliding_attention": local},
        "query_pre_attn_scalar": scalar,
        "final_logit_softcapping": None if not softcap else _float32(softcap),
    }


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
    if "rope_factors_long.weight" in file.tensors:  # Phi-3's LongRoPE
        long, short = (file.tensors.get(f"rope_factors_{part}.weight") for part in ("long", "short"))
        if short is None or long.data.size != rotary_dim // 2 or short.data.size != rotary_dim // 2:
            raise ValueError(
                f"{file.path} scales its rope by LongRoPE factors, which need rope_factors_long and "
                f"rope_factors_short tensors of {rotary_dim // 2} values each (half the rotary dimensions)."
            )
        longrope: dict[str, Any] = {
            "rope_type": "longrope",
            "long_factor": [_float32(v) for v in np.asarray(long.data, dtype=np.float32)],
            "short_factor": [_float32(v) for v in np.asarray(short.data, dtype=np.float32)],
            "original_max_position_embeddings": int(file.require(f"{arch}.rope.scaling.original_context_length")),
        }
        attn_factor = file.value(f"{arch}.rope.scaling.attn_factor")
        if attn_factor is not None:
            longrope["attention_factor"] = _float32(attn_factor)
        return longrope
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


def hf_name(name: str, arch: str = "llama") -> str | None:
    """The HF name of a llama.cpp tensor name, None for one that is read into the config; a
    ValueError for one with no place in the model. A mixture of experts' stacked tensors
    (``blk.N.ffn_gate_exps.weight``) name ``model.layers.N.mlp.experts.gate_proj.weight``, whose
    expert :func:`gguf_tensors` puts in after ``experts``."""
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    if name in SKIPPED_TENSORS:
        return None
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdecimal():
        names = GEMMA3_LAYER_NAMES if arch == "gemma3" else LAYER_NAMES
        if parts[2] in names:
            return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
        if parts[2] in EXPERT_NAMES:
            return f"model.layers.{parts[1]}.mlp.experts.{EXPERT_NAMES[parts[2]]}.{parts[3]}"
        if parts[2] == "attn_qkv":  # Phi-3's fused q, k and v, split by gguf_tensors
            return f"model.layers.{parts[1]}.self_attn.qkv_proj.{parts[3]}"
    raise ValueError(f"GGUF tensor {name!r} has no place in the model.")


def unpermute_from_ggml_rope(rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rows of a q or k projection (weight or bias; ``num_heads`` heads) from GGML's rope order,
    pairs ``(2j, 2j + 1)``, back to HF's, pairs ``(j, j + head_dim/2)``: the inverse of
    ``convert_hf_to_gguf.py``'s permutation."""
    n = rows.shape[0]
    return rows.reshape(num_heads, n // num_heads // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def gguf_tensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """``(HF name, tensor)`` for every tensor of the GGUF at ``path`` (see the module docstring)."""
    file = open_gguf(path)
    config = _config(file)
    arch = file.architecture
    dequantizer = GgufDequantizer()
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    head_dim = config["head_dim"]
    qkv_rows = [heads["q_proj"] * head_dim, heads["k_proj"] * head_dim, heads["k_proj"] * head_dim]
    for tensor in file.reader.tensors:
        name = hf_name(tensor.name, arch)
        if name is None:
            continue
        kind = tensor.tensor_type
        data = torch.from_numpy(tensor.data)
        if kind.name == "BF16":
            data = data.view(torch.bfloat16)
        module, suffix = name.split(".")[-2:]
        prefix = name[: -len(module) - len(suffix) - 2]
        if arch == "llama" and module in heads:
            data = unpermute_from_ggml_rope(data, heads[module])
        if arch == "gemma3" and tensor.name.endswith("norm.weight"):
            data = data.float() - 1  # llama.cpp stores Gemma's 1 + weight, the checkpoint the weight
        if prefix.endswith(".experts"):  # [experts, outputs, inputs]: each expert's weight
            parts = [(f"{prefix}.{expert}.{module}.{suffix}", data[expert]) for expert in range(data.shape[0])]
        elif module == "qkv_proj":
            names = [f"{prefix}.{p}_proj.{suffix}" for p in "qkv"]
            parts = _split_rows(tensor.name, data, qkv_rows, names)
        elif arch == "phi3" and module == "up_proj":  # gate then up
            rows = [config["intermediate_size"]] * 2
            names = [f"{prefix}.gate_proj.{suffix}", name]
            parts = _split_rows(tensor.name, data, rows, names)
        else:
            parts = [(name, data)]
        for part_name, part in parts:
            if part.dim() == 2:
                kept = QuantizedCheckpoint(tensor.name, "weight", TYPE_TENSOR, torch.tensor(int(kind)), dequantizer)
                setattr(part, QUANTIZED_ATTR, kept)
            yield part_name, part


def _split_rows(name: str, data: torch.Tensor, rows: list[int], names: list[str]) -> list[tuple[str, torch.Tensor]]:
    """A fused tensor's rows (whole outputs, so whole blocks of a quantized one) as its parts."""
    if data.shape[0] != sum(rows):
        raise ValueError(
            f"GGUF tensor {name!r} has {data.shape[0]} rows; the config's shapes need {' + '.join(map(str, rows))}."
        )
    return list(zip(names, data.split(rows)))
