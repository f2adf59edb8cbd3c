"""A GGUF of a checkpoint for the llama.cpp peer (and for tests of GGUF loading), written with
the ``gguf`` package.

The tensors are the checkpoint's, renamed to llama.cpp's names and cast to the bench dtype
(bf16 by default; the norms stay fp32, as ``convert_hf_to_gguf.py`` keeps 1-D tensors), with
the q and k projections permuted for GGML's rope as ``convert_hf_to_gguf.py`` does for Llama:
HF orders each head's rotary pairs as two halves, GGML's rope as neighbours.

The bench gives llama.cpp token ids, never text, so the vocabulary only has to load: a
SentencePiece-shaped list of ``vocab_size`` tokens (``<unk>``, the checkpoint's BOS and EOS,
the 256 byte tokens, then placeholders), all scores 0.

The file is cached beside the checkpoint directory, named by a hash of the checkpoint's
files (config and safetensors), the dtype and :data:`FORMAT_VERSION`.

:func:`write_gguf` also writes Mistral (as GGUF's ``llama``), Qwen2, Qwen3, Qwen3-MoE, Mixtral,
Phi-3 and Gemma 3 checkpoints with the transformations ``convert_hf_to_gguf.py`` applies to them
(each layer's experts stacked into ``ffn_*_exps`` [experts, outputs, inputs], the router kept in
float32; Phi-3's fused projections kept fused, its LongRoPE factors as tensors; Gemma's norms
stored as ``1 + weight``), refusing what llama.cpp's model of the family cannot express. It writes the
checkpoint's own byte-level BPE tokenizer (``tokenizer=True``) and quantized files: every linear
weight and the token embedding as ``Q8_0``, ``Q4_0``, ``Q4_K``, ``Q5_K`` or ``Q6_K`` blocks
(:mod:`engine.model_loader.gguf_quantize`, round-to-nearest), or ``Q4_K_M``: ``Q4_K`` with the output
head, and ``attn_v`` and ``ffn_down`` of the layers llama.cpp gives more bits, in ``Q6_K``, as
llama.cpp's mix of that name has them.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

FORMAT_VERSION = 1  # bump when the file written changes, so that cached files are written anew
ARCHITECTURE = "llama"
# HF architecture -> GGUF general.architecture (Mistral is GGUF's llama)
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3moe",
    "MixtralForCausalLM": "llama",  # with llama.expert_count
    "Phi3ForCausalLM": "phi3",
    "Gemma3ForCausalLM": "gemma3",
}
# quantized file -> (type of the linear weights and the token embedding, type of the output head and,
# in Q4_K_M, of attn_v and ffn_down in the layers llama.cpp gives more bits)
QUANTIZATIONS = {
    "Q8_0": ("Q8_0", "Q8_0"),
    "Q4_0": ("Q4_0", "Q4_0"),
    "Q4_K": ("Q4_K", "Q4_K"),
    "Q5_K": ("Q5_K", "Q5_K"),
    "Q6_K": ("Q6_K", "Q6_K"),
    "Q4_K_M": ("Q4_K", "Q6_K"),
}
K_SUPER_BLOCK = 256
K_FALLBACKS = {"Q4_K": "Q4_0", "Q5_K": "Q8_0", "Q6_K": "Q8_0"}
FILE_TYPE_NAMES = {"Q8_0": "MOSTLY_Q8_0", "Q4_0": "MOSTLY_Q4_0", "Q4_K": "MOSTLY_Q4_K_S", "Q5_K": "MOSTLY_Q5_K_S"}
FILE_TYPE_NAMES |= {"Q6_K": "MOSTLY_Q6_K", "Q4_K_M": "MOSTLY_Q4_K_M"}
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
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",  # a mixture of experts' router
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight",  # Phi-3's fused projections
    "mlp.gate_up_proj.weight": "ffn_up.weight",
}
# Gemma 3's norms around the attention and the MLP (its ffn_norm is the one before the MLP)
GEMMA3_LAYER_NAMES = LAYER_NAMES | {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
# what llama.cpp's gemma3 fixes: every sixth layer global, the local layers' rope base
GEMMA3_GLOBAL_EVERY = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0
GEMMA3_27B_LAYERS = 62
# one expert's weight (``mlp.experts.E.gate_proj.weight``, Mixtral's ``block_sparse_moe.experts.E.w1.weight``)
# -> the tensor stacking every expert's ([experts, outputs, inputs])
EXPERT_NAMES = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
EXPERT_NAMES |= {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}
# tensors llama.cpp keeps in float32 when it quantizes a file
UNQUANTIZED = ("ffn_gate_inp.weight",)
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


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    """llama.cpp's name of an HF Llama parameter (or of a layer's stacked experts,
    ``model.layers.N.experts.gate_proj.weight``, see :func:`_stacked_experts`); a ValueError names
    one it has no place for."""
    if hf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf_name]
    parts = hf_name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdecimal():
        names = GEMMA3_LAYER_NAMES if arch == "gemma3" else LAYER_NAMES
        if parts[3] in names:
            return f"blk.{parts[2]}.{names[parts[3]]}"
        kind, _, suffix = parts[3].partition(".")[2].partition(".")
        if parts[3].startswith("experts.") and kind in EXPERT_NAMES and suffix == "weight":
            return f"blk.{parts[2]}.{EXPERT_NAMES[kind]}.weight"
    raise ValueError(f"The GGUF export knows no llama.cpp tensor for the checkpoint's {hf_name!r}.")


EXPERT_TENSOR = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")


def _stacked_experts(tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each layer's per-expert weights stacked, as
    ``convert_hf_to_gguf.py`` merges them: ``model.layers.N.experts.P.weight`` [experts, outputs,
    inputs] in expert order, ``P`` the checkpoint's projection name (``gate_proj``, Mixtral's ``w1``)."""
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, tensor in tensors:
        match = EXPERT_TENSOR.match(name)
        if match is None:
            yield name, tensor
        else:
            experts.setdefault((match[1], match[3]), {})[int(match[2])] = tensor
    for (layer, kind), by_expert in experts.items():
        if sorted(by_expert) != list(range(len(by_expert))):
            raise ValueError(f"Layer {layer}'s {kind} experts are not numbered 0 to {len(by_expert) - 1}.")
        yield f"model.layers.{layer}.experts.{kind}.weight", torch.stack([by_expert[i] for i in range(len(by_expert))])


def longrope_factors(shape: LlamaShape) -> dict[str, np.ndarray]:
    """Phi-3's LongRoPE factors as ``convert_hf_to_gguf.py`` writes them: ``rope_factors_long`` and
    ``rope_factors_short``, one float32 a rotary frequency."""
    rope = shape.rope_scaling or {}
    half = (shape.rotary_dim or shape.head_dim) // 2
    factors = {
        f"rope_factors_{part}.weight": np.asarray(rope[f"{part}_factor"], np.float32) for part in ("long", "short")
    }
    for name, values in factors.items():
        if values.shape != (half,):
            raise ValueError(f"LongRoPE's {name} needs {half} factors (half the rotary dimensions), not {values.size}.")
    return factors


def longrope_attention_factor(shape: LlamaShape) -> float:
    """The attention scaling of Phi-3's LongRoPE: the checkpoint's ``attention_factor``, or
    ``sqrt(1 + ln(scale) / ln(original context))`` for a context ``scale`` times the original."""
    rope = shape.rope_scaling or {}
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    original = shape.original_context_length or shape.context_length
    scale = shape.context_length / original
    return math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0


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
    architecture: str = ARCHITECTURE  # GGUF's general.architecture
    rope_scaling: dict[str, Any] | None = None  # Llama 3.1's (rope_freqs) or Phi-3's LongRoPE (rope_factors_*)
    num_experts: int = 0  # a mixture of experts: experts, experts a token and the experts' intermediate size
    num_experts_per_tok: int = 0
    expert_intermediate_size: int = 0
    rotary_dim: int | None = None  # Phi-3's partial rotary factor; None: head_dim
    sliding_window: int = 0  # Phi-3's sliding window (0: none)
    original_context_length: int | None = None  # Phi-3's pre-training context
    final_logit_softcapping: float | None = None  # Gemma 3's


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
    shape = model_shape(config)
    if shape.rope_scaling is not None:
        raise ValueError(
            f"The GGUF export writes plain rope only; the checkpoint's rope_type is {shape.rope_scaling['rope_type']!r}."
        )
    return shape


def model_shape(config: dict[str, Any]) -> LlamaShape:
    """The fields of a Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral or Phi-3 ``config.json``
    the GGUF needs; a ValueError for what it cannot express."""
    architectures = config.get("architectures") or []
    if architectures[:1] and architectures[0] in ARCHITECTURES:
        architecture = ARCHITECTURES[architectures[0]]
    else:
        raise ValueError(
            f"The GGUF export writes {', '.join(ARCHITECTURES)} checkpoints; this one is "
            f"{architectures or config.get('model_type')}."
        )
    if config.get("mlp_bias") or (architecture != "qwen2" and config.get("attention_bias")):
        raise ValueError("The GGUF export writes the attention biases of Qwen2 only.")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if architecture == "gemma3":
        rope = gemma3_rope(config)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "su" and architecture == "phi3":
        rope_type = "longrope"
    supported = {("phi3", "longrope"), ("gemma3", "linear")}
    if rope_type not in ("default", "llama3") and (architecture, rope_type) not in supported:
        raise ValueError(
            f"The GGUF export writes plain rope, Llama 3.1's (as rope_freqs) and Phi-3's LongRoPE (as "
            f"rope_factors_long/short); the checkpoint's rope_type is {rope_type!r}."
        )
    num_heads = int(config["num_attention_heads"])
    hidden_size = int(config["hidden_size"])
    num_experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    if architecture == "qwen3moe" and (config.get("mlp_only_layers") or int(config.get("decoder_sparse_step", 1)) != 1):
        raise ValueError("GGUF's qwen3moe has experts in every layer; the checkpoint has dense layers too.")
    if architecture == "qwen3moe" and not config.get("norm_topk_prob", False):
        raise ValueError(
            "llama.cpp's qwen3moe renormalises the top-k expert weights; the checkpoint's norm_topk_prob is false."
        )
    head_dim = int(config.get("head_dim") or hidden_size // num_heads)
    partial = float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))

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
        head_dim=head_dim,
        context_length=int(config.get("max_position_embeddings", 4096)),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        bos_token_id=token_id("bos_token_id"),
        eos_token_id=token_id("eos_token_id"),
        architecture=architecture,
        rope_scaling={**rope, "rope_type": rope_type} if rope_type != "default" else None,
        num_experts=num_experts,
        num_experts_per_tok=int(config.get("num_experts_per_tok") or 0) if num_experts else 0,
        expert_intermediate_size=int(config.get("moe_intermediate_size") or config["intermediate_size"])
        if num_experts
        else 0,
        # llama.cpp's int(partial_rotary_factor * hidden) // heads
        rotary_dim=int(partial * hidden_size) // num_heads if architecture == "phi3" else None,
        sliding_window=int(config.get("sliding_window") or 0) if architecture in ("phi3", "gemma3") else 0,
        original_context_length=int(
            rope.get("original_max_position_embeddings")
            or config.get("original_max_position_embeddings")
            or config.get("max_position_embeddings", 4096)
        )
        if architecture == "phi3"
        else None,
        final_logit_softcapping=config.get("final_logit_softcapping") if architecture == "gemma3" else None,
    )


def gemma3_rope(config: dict[str, Any]) -> dict[str, Any]:
    """A Gemma 3 config's global layers' rope parameters, checked against what llama.cpp's gemma3
    can express (a ValueError otherwise): with a sliding window, every sixth layer global; local
    layers with rope base 10000, unscaled; queries scaled by ``head_dim ** -0.5`` (27B: ``(hidden /
    heads) ** -0.5``)."""
    num_layers, window = int(config["num_hidden_layers"]), config.get("sliding_window")
    types = config.get("layer_types") or [
        "sliding_attention" if (i + 1) % int(config.get("sliding_window_pattern", 6)) else "full_attention"
        for i in range(num_layers)
    ]
    expected = [
        "sliding_attention" if window and (i + 1) % GEMMA3_GLOBAL_EVERY else "full_attention" for i in range(num_layers)
    ]
    if list(types) != expected:
        raise ValueError(
            f"llama.cpp's gemma3 makes every {GEMMA3_GLOBAL_EVERY}th layer global (all of them without a sliding "
            f"window); the checkpoint's layer_types are {types}."
        )
    rope = config.get("rope_parameters") or {}
    full = dict(rope.get("full_attention", rope))
    local = dict(rope.get("sliding_attention") or {"rope_theta": config.get("rope_local_base_freq", 10000.0)})
    if local.get("rope_type", "default") != "default" or float(local["rope_theta"]) != GEMMA3_LOCAL_ROPE_BASE:
        raise ValueError(
            f"llama.cpp's gemma3 gives the local layers plain rope of base {GEMMA3_LOCAL_ROPE_BASE:g}; the "
            f"checkpoint's are {local}."
        )
    heads, head_dim = int(config["num_attention_heads"]), int(config.get("head_dim", 256))
    scalar = int(config["hidden_size"]) // heads if num_layers == GEMMA3_27B_LAYERS else head_dim
    if float(config.get("query_pre_attn_scalar", 256)) != scalar:
        raise ValueError(
            f"llama.cpp's gemma3 scales the queries by {scalar} ** -0.5 for this shape; the checkpoint's "
            f"query_pre_attn_scalar is {config.get('query_pre_attn_scalar', 256)}."
        )
    if config.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ValueError(f"llama.cpp's gemma3 uses gelu_pytorch_tanh, not {config['hidden_activation']!r}.")
    return full


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


def checkpoint_digest(model_path: str | Path, dtype: str, quantization: str | None = None) -> str:
    """sha256 over the format version, the dtype (and quantization) and the bytes of config.json
    and every ``*.safetensors`` file (by name, in order)."""
    model_path = Path(model_path)
    settings = dtype if quantization is None else f"{dtype} {quantization}"
    digest = hashlib.sha256(f"gguf-export {FORMAT_VERSION} {settings}\n".encode())
    for path in [model_path / "config.json", *checkpoint_files(model_path)]:
        digest.update(f"{path.name} {path.stat().st_size}\n".encode())
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


def gguf_path(model_path: str | Path, dtype: str, quantization: str | None = None) -> Path:
    """Where the GGUF of ``model_path`` in ``dtype`` (or ``quantization``) is cached: beside the
    checkpoint directory."""
    model_path = Path(model_path).resolve()
    key = checkpoint_digest(model_path, dtype, quantization)[:16]
    kind = quantization or GGUF_TYPES[dtype]
    return model_path.parent / f"{model_path.name}.{key}.{kind.lower()}.gguf"


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


def bpe_vocabulary(model_path: Path, vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """The byte-level BPE tokenizer of ``model_path/tokenizer.json`` as GGUF lists: ``vocab_size``
    tokens by id (added tokens control, ids the tokenizer lacks ``[PAD<id>]`` placeholders,
    unused), their types, and the merges (``"a b"``)."""
    from gguf import TokenType

    path = model_path / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"tokenizer=True writes the checkpoint's tokenizer.json; {model_path} has none.")
    with open(path, encoding="utf-8") as f:
        spec = json.load(f)
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise ValueError(f"The GGUF export writes byte-level BPE tokenizers; {path} is {model.get('type')!r}.")
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [int(TokenType.UNUSED)] * vocab_size
    for text, token_id in model["vocab"].items():
        if token_id < vocab_size:
            tokens[token_id], types[token_id] = text, int(TokenType.NORMAL)
    for added in spec.get("added_tokens") or []:
        if added["id"] < vocab_size:
            kind = TokenType.CONTROL if added.get("special") else TokenType.USER_DEFINED
            tokens[added["id"]], types[added["id"]] = added["content"], int(kind)
    merges = [merge if isinstance(merge, str) else " ".join(merge) for merge in model.get("merges") or []]
    return tokens, types, merges


def llama3_rope_freqs(shape: LlamaShape) -> np.ndarray:
    """The ``rope_freqs`` tensor ``convert_hf_to_gguf.py`` writes for Llama 3.1's rope scaling:
    per rotary frequency, the factor its wavelength is multiplied by."""
    rope = shape.rope_scaling or {}
    factor, low, high = float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    old = float(rope["original_max_position_embeddings"])
    factors = []
    for i in range(0, shape.head_dim, 2):
        wavelen = 2 * math.pi / (1.0 / shape.rope_theta ** (i / shape.head_dim))
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _more_bits(target: str, num_layers: int) -> bool:
    """Whether llama.cpp's Q4_K_M writes ``target`` (``blk.N.attn_v`` / ``ffn_down`` /
    ``ffn_down_exps``) in Q6_K: the first and last eighth of the layers and every third one
    between (its ``use_more_bits``)."""
    parts = target.split(".")
    if len(parts) != 4 or parts[2] not in ("attn_v", "ffn_down", "ffn_down_exps"):
        return False
    i, n = int(parts[1]), num_layers
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def fallback_type(quant_type: str, row: int) -> str:
    """``quant_type``, or for a K-quant whose rows do not split into its 256-value super-blocks the
    32-value type llama.cpp's quantizer falls back to (Q6_K -> Q8_0; Q4_K and Q5_K to Q4_0 and Q8_0,
    where llama.cpp takes Q5_0 and Q5_1, which the engine does not read)."""
    if quant_type in K_FALLBACKS and row % K_SUPER_BLOCK:
        return K_FALLBACKS[quant_type]
    return quant_type


def _quantized_array(name: str, tensor: torch.Tensor, quant_type: str) -> tuple[np.ndarray, Any]:
    from gguf import GGMLQuantizationType

    from engine.model_loader.gguf_quantize import quantize_blocks

    try:
        if tensor.dim() == 3:  # stacked experts: each its rows of blocks
            blocks = np.stack([quantize_blocks(expert.float().numpy(), quant_type) for expert in tensor])
            return blocks, getattr(GGMLQuantizationType, quant_type)
        return quantize_blocks(tensor.float().numpy(), quant_type), getattr(GGMLQuantizationType, quant_type)
    except ValueError as exc:
        raise ValueError(f"{name} cannot be written as {quant_type}: {exc}") from None


def write_gguf(
    model_path: str | Path,
    out: str | Path,
    dtype: str = "bfloat16",
    *,
    quantization: str | None = None,
    tokenizer: bool = False,
) -> Path:
    """Write the GGUF of the checkpoint at ``model_path`` to ``out``: its 2-D tensors in
    ``dtype``, or with ``quantization`` (a key of :data:`QUANTIZATIONS`) its linear weights and
    token embedding quantized; the vocabulary a placeholder one, or the checkpoint's own BPE
    tokenizer with ``tokenizer``."""
    gguf = require_gguf()
    if dtype not in GGUF_TYPES:
        raise ValueError(f"The GGUF export writes {', '.join(GGUF_TYPES)}, not {dtype!r}.")
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"The GGUF export quantizes to {', '.join(QUANTIZATIONS)}, not {quantization!r}.")
    model_path = Path(model_path)
    with open(model_path / "config.json", encoding="utf-8") as f:
        shape = model_shape(json.load(f))

    arch = shape.architecture
    writer = gguf.GGUFWriter(str(out), arch=arch)
    writer.add_name(model_path.name)
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.hidden_size)
    writer.add_block_count(shape.num_layers)
    writer.add_feed_forward_length(shape.intermediate_size)
    writer.add_head_count(shape.num_heads)
    writer.add_head_count_kv(shape.num_kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_dimension_count(shape.rotary_dim or shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_norm_eps)
    writer.add_vocab_size(shape.vocab_size)
    if shape.num_experts:
        writer.add_expert_count(shape.num_experts)
        writer.add_expert_used_count(shape.num_experts_per_tok)
        if arch == "qwen3moe":
            writer.add_expert_feed_forward_length(shape.expert_intermediate_size)
    if arch == "gemma3":
        if shape.sliding_window:
            writer.add_sliding_window(shape.sliding_window)
        writer.add_rope_freq_base_swa(GEMMA3_LOCAL_ROPE_BASE)
        if shape.final_logit_softcapping:
            writer.add_final_logit_softcapping(shape.final_logit_softcapping)
        if shape.rope_scaling is not None:  # linear, on the global layers
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(float(shape.rope_scaling["factor"]))
    if arch == "phi3":  # as convert_hf_to_gguf.py writes Phi-3: a sliding window of 0 is none
        writer.add_rope_scaling_orig_ctx_len(shape.original_context_length)
        writer.add_sliding_window(shape.sliding_window)
    file_type = FILE_TYPE_NAMES[quantization] if quantization else FILE_TYPES[dtype]
    writer.add_file_type(int(getattr(gguf.LlamaFileType, file_type)))

    if tokenizer:
        tokens, types, merges = bpe_vocabulary(model_path, shape.vocab_size)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
    else:
        tokens, types = vocabulary(shape)
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores([0.0] * len(tokens))
        writer.add_token_types(types)
        writer.add_unk_token_id(0)
    for token_id, add in ((shape.bos_token_id, writer.add_bos_token_id), (shape.eos_token_id, writer.add_eos_token_id)):
        if token_id is not None and 0 <= token_id < len(tokens) and types[token_id] == int(gguf.TokenType.CONTROL):
            add(token_id)
    writer.add_add_bos_token(False)

    layer_type, head_type = QUANTIZATIONS[quantization] if quantization else (None, None)
    if shape.rope_scaling is not None and shape.rope_scaling["rope_type"] == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_freqs(shape), raw_dtype=gguf.GGMLQuantizationType.F32)
    elif shape.rope_scaling is not None and shape.rope_scaling["rope_type"] == "longrope":
        for name, factors in longrope_factors(shape).items():
            writer.add_tensor(name, factors, raw_dtype=gguf.GGMLQuantizationType.F32)
        writer.add_rope_scaling_attn_factors(longrope_attention_factor(shape))
    written = set()
    for name, tensor in _stacked_experts(_tensors(model_path)):
        if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and shape.tie_word_embeddings):
            continue
        target = gguf_name(name, arch)
        if arch == "gemma3" and name.endswith("norm.weight"):
            tensor = tensor.float() + 1  # Gemma's norms scale by 1 + weight: llama.cpp stores the sum
        if arch == "llama" and name.endswith("self_attn.q_proj.weight"):
            tensor = permute_for_ggml_rope(tensor, shape.num_heads)
        elif arch == "llama" and name.endswith("self_attn.k_proj.weight"):
            tensor = permute_for_ggml_rope(tensor, shape.num_kv_heads)
        if tensor.dim() >= 2 and layer_type is not None and not target.endswith(UNQUANTIZED):
            more_bits = quantization == "Q4_K_M" and _more_bits(target, shape.num_layers)
            kind_name = head_type if target == "output.weight" or more_bits else layer_type
            data, kind = _quantized_array(target, tensor, fallback_type(kind_name, tensor.shape[-1]))
        else:
            data, kind = _gguf_array(tensor, dtype)
        writer.add_tensor(target, data, raw_dtype=kind)
        written.add(target)
    expected = {"token_embd.weight", "output_norm.weight"} | {
        f"blk.{i}.{suffix}" for i in range(shape.num_layers) for suffix in required_layer_tensors(shape)
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


def required_layer_tensors(shape: LlamaShape) -> list[str]:
    """The GGUF names (after ``blk.N.``) every layer of ``shape``'s architecture has."""
    names = ["attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight"]
    if shape.architecture == "phi3":
        names = ["attn_qkv.weight", "attn_output.weight"]
    if shape.num_experts:
        names += ["ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"]
    elif shape.architecture == "phi3":
        names += ["ffn_up.weight", "ffn_down.weight"]
    else:
        names += ["ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"]
    if shape.architecture == "qwen2":
        names += ["attn_q.bias", "attn_k.bias", "attn_v.bias"]
    if shape.architecture in ("qwen3", "qwen3moe", "gemma3"):
        names += ["attn_q_norm.weight", "attn_k_norm.weight"]
    if shape.architecture == "gemma3":
        names += ["attn_norm.weight", "post_attention_norm.weight", "ffn_norm.weight", "post_ffw_norm.weight"]
    return names


def cached_gguf(model_path: str | Path, dtype: str = "bfloat16", quantization: str | None = None) -> Path:
    """The GGUF of ``model_path`` in ``dtype`` (its linear weights in ``quantization``, a key of
    :data:`QUANTIZATIONS`), written once beside the checkpoint (see :func:`gguf_path`)."""
    require_gguf()
    if dtype not in GGUF_TYPES:
        raise ValueError(f"The GGUF export writes {', '.join(GGUF_TYPES)}, not {dtype!r}.")
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"The GGUF export quantizes to {', '.join(QUANTIZATIONS)}, not {quantization!r}.")
    path = gguf_path(model_path, dtype, quantization)
    if not path.exists():
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        try:
            write_gguf(model_path, partial, dtype, quantization=quantization)
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


def main(argv: list[str] | None = None) -> None:
    """``python -m engine.bench.gguf_export CHECKPOINT OUT.gguf [--dtype D] [--quantization Q] [--tokenizer]``."""
    import argparse

    parser = argparse.ArgumentParser(description="Write a checkpoint as a GGUF file (engine.bench.gguf_export).")
    parser.add_argument("checkpoint", help="checkpoint directory (config.json + safetensors)")
    parser.add_argument("out", help="the .gguf file to write")
    parser.add_argument("--dtype", default="bfloat16", choices=list(GGUF_TYPES), help="dtype of unquantized tensors")
    parser.add_argument("--quantization", choices=list(QUANTIZATIONS), help="quantize the linear weights")
    parser.add_argument("--tokenizer", action="store_true", help="write the checkpoint's BPE tokenizer.json")
    args = parser.parse_args(argv)
    path = write_gguf(args.checkpoint, args.out, args.dtype, quantization=args.quantization, tokenizer=args.tokenizer)
    print(path)


if __name__ == "__main__":
    main()
