"""FP8 linear layers: ``fp8`` (DeepSeek's and transformers' block-scaled e4m3 checkpoints, and
``--quantization fp8`` of a bf16 / fp16 checkpoint) and ``compressed-tensors`` checkpoints in
``float-quantized`` (an e4m3 weight with a factor per output channel, per tensor, per block or
per group of a row).

A layer holds ``weight`` (float8_e4m3fn [out, in]) and ``weight_scale`` (float32 [out,
⌈in / block_k⌉]): one factor per output row and ``block_k`` input columns, ``block_k`` the
checkpoint's scale block along the input (128 for DeepSeek; all of the input for per-channel
and per-tensor scales, so one column). Keeping a factor per row rather than per 128 rows lets
fused layers (q / k / v, gate / up) stack shards whose row counts are not multiples of the
block, and tensor-parallel ranks cut their rows anywhere; it costs 4 bytes per ``block_k``
weight bytes (3% at 128).

How a layer multiplies, chosen once it has loaded, by where its weight lies:

- a GPU with FP8 tensor cores (compute capability 8.9+): ``engine_cuda.fp8_gemm``'s Triton
  GEMM, the activations quantized per row and ``block_k`` group to e4m3 as it runs (W8A8, as
  DeepSeek's inference code and vLLM run these checkpoints; a checkpoint's static
  ``input_scale`` is not used);
- an older GPU: the weight dequantized once to the model's dtype, then ``F.linear``;
- anywhere else (the CPU): the platform's ``layer.ops.fp8_linear``, which keeps the e4m3
  weight (engine-cpu: a kernel that widens the bytes in registers for decode rows, tiles
  dequantized for the BLAS for more; the reference elsewhere: the dequantized product, the
  values the GPU paths are held to).

Routed MoE experts (:class:`Fp8ExpertsMethod`) are held the same way, each expert projection
an :class:`engine.interfaces.fp8.Fp8Weight` computed by the platform's ``fp8_linear`` on every
platform: the loader hands a prequantized one over as its e4m3 weight carrying its scale, and
``--quantization fp8`` quantizes a dense one as it loads.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from engine.interfaces.fp8 import Fp8Weight
from engine.interfaces.quantizer import ExpertsMethod, LinearMethod, Quantizer
from engine.layers.quantized_checkpoint import quantized_checkpoint
from engine.model_loader.dequant import declines_other_formats, fp8_block_size

logger = logging.getLogger("engine.cuda")

E4M3_MAX = 448.0
DEFAULT_BLOCK = (128, 128)  # DeepSeek's, and what --quantization fp8 quantizes in
FLOAT_FORMAT = "float-quantized"
KERNELS = ("triton", "dense", "ops")
SCALE_NAMES = ("weight_scale_inv", "weight_scale")  # a weight's scale: DeepSeek's, compressed-tensors'


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


def quantize_fp8_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (e4m3 [N, K], float32 factors [⌈N/bn⌉, ⌈K/bk⌉]): each block divided by
    its largest magnitude / 448 (an all-zero block by 1) and rounded to e4m3, DeepSeek's layout."""
    n, k = weight.shape
    bn, bk = min(block[0], n), min(block[1], k)
    rows, cols = -(-n // bn), -(-k // bk)
    padded = F.pad(weight.float(), (0, cols * bk - k, 0, rows * bn - n))
    blocks = padded.view(rows, bn, cols, bk)
    scales = blocks.abs().amax(dim=(1, 3)) / E4M3_MAX
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = (blocks / scales[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(rows * bn, cols * bk)[:n, :k].contiguous(), scales


def per_row_scales(name: str, scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int] | None):
    """A shard's checkpoint scales -> one factor per row and block of ``block[1]`` columns
    ([rows, ⌈cols / block_k⌉]; [rows, 1] with ``block`` None, per channel or per tensor)."""
    scale = scale.float()
    if block is None:
        if scale.numel() == 1:
            return scale.reshape(1, 1).expand(rows, 1).contiguous()
        if tuple(scale.shape) in ((rows, 1), (rows,)):
            return scale.reshape(rows, 1).contiguous()
        raise ValueError(
            f"{name}: a per-channel or per-tensor scale of a [{rows}, {cols}] weight is [{rows}, 1] or one "
            f"value, the checkpoint has {tuple(scale.shape)}."
        )
    bn, bk = block
    expected = (-(-rows // bn), -(-cols // bk))
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"{name}: a [{rows}, {cols}] weight in blocks of {block} has {expected} scales, the checkpoint "
            f"{tuple(scale.shape)}."
        )
    return scale.repeat_interleave(bn, dim=0)[:rows].contiguous()


def k_tile(scale_k: int, k: int) -> int | None:
    """The Triton GEMM's K tile for scales every ``scale_k`` columns: one that divides the
    scale block (or any, when one block spans K), at least 16 (``tl.dot``'s least); None when
    no tile fits."""
    if scale_k >= k:
        return 64
    return next((tile for tile in (64, 32, 16) if scale_k % tile == 0), None)


class Fp8LinearMethod(LinearMethod):
    """See the module docstring. ``block``: the checkpoint's scale block (rows, columns), or
    None for per-channel / per-tensor scales; ``scale_name``: the checkpoint tensor holding
    them; ``prequantized``: the checkpoint is FP8 (else each dense shard is quantized in
    ``block`` blocks as it loads); ``kernel``: force one of ``triton``, ``dense`` or ``ops`` (the
    platform's ``fp8_linear``, whose reference is the dequantized product) instead of choosing by
    device."""

    def __init__(
        self,
        block: tuple[int, int] | None,
        scale_name: str,
        *,
        prequantized: bool,
        kernel: str | None = None,
        quantize_activations: bool = True,
    ) -> None:
        if kernel is not None and kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}.")
        self.block = block
        self.scale_name = scale_name
        self.prequantized = prequantized
        self.forced_kernel = kernel
        self.quantize_activations = quantize_activations

    # layout

    def scale_k(self, input_size: int) -> int:
        """Input columns one factor covers."""
        return input_size if self.block is None else min(self.block[1], input_size)

    def create_weights(self, layer, input_size, output_sizes, bias, dtype) -> None:
        rows = sum(output_sizes)
        groups = -(-input_size // self.scale_k(input_size))
        layer.weight = _frozen(torch.empty(rows, input_size, dtype=torch.float8_e4m3fn))
        layer.weight_scale = _frozen(torch.ones(rows, groups, dtype=torch.float32))
        layer.bias = _frozen(torch.empty(rows, dtype=dtype)) if bias else None
        layer.fp8_kernel = None

    def checkpoint_tensors(self, layer) -> tuple[str, ...]:
        names = ("weight", self.scale_name) if self.prequantized else ("weight",)
        return (*names, "bias") if layer.has_bias else names

    def local_part(self, layer, name: str, shard: int, tensor: torch.Tensor) -> torch.Tensor:
        """Scales become one per row first (so a rank takes its rows like the weight's), and a
        row-parallel rank takes the scale columns of its input columns, which must start and
        end on the checkpoint's scale blocks."""
        if name != self.scale_name:
            return layer.local_part(name, shard, tensor)
        full_rows = layer.full_output_sizes[shard]
        rows = per_row_scales(f"{name}[{shard}]", tensor, full_rows, layer.full_input_size, self.block)
        if layer.out_slices is not None:
            return layer.local_part(name, shard, rows)
        if layer.in_slice is not None and rows.shape[1] > 1:
            start, length = layer.in_slice
            scale_k = self.scale_k(layer.full_input_size)
            if start % scale_k or (length % scale_k and start + length != layer.full_input_size):
                raise ValueError(
                    layer._unsplittable(
                        name,
                        tensor,
                        f"rank {layer.tp.rank}'s inputs [{start}, {start + length}) cut its {scale_k}-column scale blocks",
                    )
                )
            return rows[:, start // scale_k : -(-(start + length) // scale_k)]
        return rows

    def load_weight(self, layer, name: str, shard: int, tensor: torch.Tensor) -> None:
        rows = layer._rows(shard)
        if name == "weight" and self.prequantized:
            if tensor.dtype != torch.float8_e4m3fn:
                raise ValueError(
                    f"Shard {shard}'s weight is {tensor.dtype}, not float8_e4m3fn: the checkpoint left this "
                    f"layer unquantized (list it in the quantization_config's modules_to_not_convert / ignore)."
                )
            layer.load_shard("weight", shard, tensor)
        elif name == "weight":  # quantized as it loads, in the checkpoint layout's blocks
            block = self.block or (tensor.shape[0], tensor.shape[1])
            q, scales = quantize_fp8_blocks(tensor, block)
            layer.weight.data[rows].copy_(q)
            layer.weight_scale.data[rows].copy_(per_row_scales(f"weight[{shard}]", scales, *tensor.shape, block))
        elif name == self.scale_name and self.prequantized:
            target = layer.weight_scale.data[rows]
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"Shard {shard} of {name} expects {tuple(target.shape)}, got {tuple(tensor.shape)}.")
            target.copy_(tensor)
        else:
            super().load_weight(layer, name, shard, tensor)

    # running

    def dense_weight(self, layer, dtype: torch.dtype) -> torch.Tensor:
        """``weight · scale`` in ``dtype``."""
        scale_k = self.scale_k(layer.weight.shape[1])
        factors = layer.weight_scale.repeat_interleave(scale_k, dim=1)[:, : layer.weight.shape[1]]
        return (layer.weight.float() * factors).to(dtype)

    def choose_kernel(self, layer) -> str:
        if self.forced_kernel is not None:
            return self.forced_kernel
        device = layer.weight.device
        if device.type != "cuda":
            return "ops"
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            return "dense"  # no FP8 tensor cores
        return "triton" if k_tile(self.scale_k(layer.weight.shape[1]), layer.weight.shape[1]) else "dense"

    def process_weights_after_loading(self, layer) -> None:
        layer.fp8_kernel = self.choose_kernel(layer)
        if layer.fp8_kernel == "dense":
            layer.weight = _frozen(self.dense_weight(layer, layer.dtype))
            del layer.weight_scale

    def describe(self) -> str | None:
        blocks = "per channel" if self.block is None else f"{self.block[0]}x{self.block[1]} blocks"
        acts = "e4m3 activations per row group" if self.quantize_activations else "activations as they come"
        return f"FP8 e4m3 weights ({blocks}), {acts} on FP8 GPUs, the platform's fp8_linear elsewhere"

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        bias = layer.bias.to(x.dtype) if layer.bias is not None else None
        kernel = layer.fp8_kernel
        if kernel == "dense":
            return F.linear(x, layer.weight, bias)
        if kernel == "triton":
            from engine_cuda.fp8_gemm import fp8_block_linear

            k = layer.weight.shape[1]
            scale_k = self.scale_k(k)
            return fp8_block_linear(
                x,
                layer.weight,
                layer.weight_scale,
                (1, scale_k),
                bias,
                quantize_activations=self.quantize_activations,
                block_k=k_tile(scale_k, k),
            )
        return layer.ops.fp8_linear(x, layer.weight, layer.weight_scale, self.scale_k(layer.weight.shape[1]), bias)


class Fp8ExpertsMethod(ExpertsMethod):
    """Routed experts in e4m3 with a factor per row and ``block[1]`` inputs (one per row with
    ``block`` None), as the linear layers of the same checkpoint: ``prequantized``, each expert
    projection's weight comes in e4m3 carrying its checkpoint scale; else it comes dense and is
    quantized in ``block`` blocks (the whole projection for None) as it loads."""

    def __init__(self, block: tuple[int, int] | None, *, prequantized: bool) -> None:
        self.block = block
        self.prequantized = prequantized

    def expert_weight(self, tensors, out_features, in_features, what) -> Fp8Weight:
        scale_names = set(tensors) & set(SCALE_NAMES)
        if "weight" not in tensors or len(tensors) != 1 + len(scale_names) or len(scale_names) > 1:
            raise ValueError(
                f"{what}: FP8 experts take a weight and its scale ({' or '.join(SCALE_NAMES)}); the checkpoint "
                f"gives {sorted(tensors)}."
            )
        weight = tensors["weight"]
        if tuple(weight.shape) != (out_features, in_features):
            raise ValueError(
                f"{what}: the model expects ({out_features}, {in_features}), the checkpoint has {tuple(weight.shape)}."
            )
        block_k = in_features if self.block is None else min(self.block[1], in_features)
        # the scale by its name, or carried by the weight (the loader keeps an FP8 weight as it is)
        kept = quantized_checkpoint(weight)
        scale = tensors[scale_names.pop()] if scale_names else kept.scale if kept is not None else None
        if self.prequantized:
            if weight.dtype != torch.float8_e4m3fn or scale is None:
                raise ValueError(
                    f"{what} is {weight.dtype}{'' if scale is not None else ' with no scale'}, not float8_e4m3fn with "
                    "its scale: the checkpoint left these experts unquantized (list them in the quantization_config's "
                    "modules_to_not_convert / ignore)."
                )
            return Fp8Weight(weight, per_row_scales(what, scale, out_features, in_features, self.block), block_k)
        if scale is not None:
            raise ValueError(f"{what}: a scale came with a dense weight that is quantized as it loads.")
        block = self.block or (out_features, in_features)
        q, scales = quantize_fp8_blocks(weight, block)
        return Fp8Weight(q, per_row_scales(what, scales, out_features, in_features, block), block_k)

    def describe(self) -> str | None:
        blocks = "per channel" if self.block is None else f"{self.block[0]}x{self.block[1]} blocks"
        return f"FP8 e4m3 experts ({blocks}), the platform's fp8_linear"


@dataclass(frozen=True)
class Skips:
    """Module names a checkpoint leaves unquantized: exact names or suffixes, ``re:`` regexes."""

    names: tuple[str, ...] = ()

    def __call__(self, layer_name: str) -> bool:
        if layer_name.split(".")[-1] in ("lm_head", "gate"):  # output head, MoE router
            return True
        for entry in self.names:
            if entry.startswith("re:"):
                if re.match(entry[3:], layer_name):
                    return True
            elif f".{entry}." in f".{layer_name}.":
                return True
        return False


def _names(config: dict[str, Any], key: str) -> tuple[str, ...]:
    value = config.get(key) or ()
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{key} must be a list of module names, got {value!r}.")
    return tuple(value)


class Fp8Quantizer(Quantizer):
    """``quant_method: fp8``: e4m3 weights with a float32 (or e8m0) factor per block of
    ``weight_block_size`` (``weight_scale_inv``), DeepSeek's format, or without a block size
    one factor per tensor or channel (``weight_scale``, AutoFP8's); ``--quantization fp8``
    quantizes a dense checkpoint in 128 × 128 blocks."""

    name: ClassVar[str] = "fp8"
    # the CPU computes its layers with the platform's fp8_linear (engine-cpu's kernel)
    supported_platforms: ClassVar[frozenset[str] | None] = frozenset({"cuda", "cpu"})
    activation_dtypes: ClassVar[frozenset[str]] = frozenset({"bfloat16", "float16", "float32"})
    # relative output error for Gaussian weights and inputs, quantized while loading in
    # 128 x 128 blocks, over 200 random [192, 256] layers: the dequantized product (what a GPU
    # without FP8 tensor cores and the kit's CPU run compute) 0.027 on average, at most 0.029;
    # with the activations in e4m3 per 128-wide group as well (FP8 GPUs) 0.037, at most 0.041
    error_bound: float = 0.05

    def __init__(self, block: tuple[int, int] | None, skips: Skips, prequantized: bool) -> None:
        self.block = block
        self.skips = skips
        self.prequantized = prequantized

    @classmethod
    def from_config(cls, quantization_config: dict[str, Any], *, prequantized: bool) -> Fp8Quantizer:
        config = dict(quantization_config)
        block = fp8_block_size(config)
        skips = Skips(_names(config, "modules_to_not_convert") + _names(config, "ignored_layers"))
        if block is None and prequantized:  # per-tensor (or per-channel) ``weight_scale``, as AutoFP8 writes
            return cls(None, skips, prequantized)
        return cls(block or DEFAULT_BLOCK, skips, prequantized)

    def get_linear_method(self, layer_name: str) -> LinearMethod | None:
        if self.skips(layer_name):
            return None
        scale_name = "weight_scale" if self.block is None else "weight_scale_inv"
        return Fp8LinearMethod(self.block, scale_name, prequantized=self.prequantized)

    def get_experts_method(self, layer_name: str) -> ExpertsMethod | None:
        if self.skips(layer_name):
            return None
        return Fp8ExpertsMethod(self.block, prequantized=self.prequantized)

    def checkpoint_config(self) -> dict[str, Any]:
        """What :meth:`export_weight`'s checkpoints hold: e4m3 in blocks (``weight_scale_inv``), as
        DeepSeek's and transformers' FP8 configs spell it; without the block size a reader would
        take the scales for one per tensor or channel."""
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(self.block or DEFAULT_BLOCK),
        }

    def export_weight(self, weight: torch.Tensor, bias: torch.Tensor | None) -> dict[str, torch.Tensor]:
        q, scales = quantize_fp8_blocks(weight, self.block or DEFAULT_BLOCK)
        tensors = {"weight": q, "weight_scale_inv": scales}
        if bias is not None:
            tensors["bias"] = bias
        return tensors


def float_weight_layout(config: dict[str, Any]) -> tuple[tuple[int, int] | None, str]:
    """A compressed-tensors ``float-quantized`` config's weight scale block (None per channel
    or tensor) and strategy; anything else is a ValueError naming it."""
    strategies = set()
    block: tuple[int, int] | None = None
    for group in (config.get("config_groups") or {}).values():
        weights = (group or {}).get("weights") or {}
        if weights.get("num_bits", 8) != 8 or weights.get("type", "float") != "float":
            raise ValueError(f"compressed-tensors weights {weights!r} are not 8-bit floats.")
        strategy = weights.get("strategy", "tensor")
        strategies.add(strategy)
        if strategy == "block":
            block = tuple(int(b) for b in weights.get("block_structure") or DEFAULT_BLOCK)  # type: ignore[assignment]
        elif strategy == "group":
            block = (1, int(weights["group_size"]))
        elif strategy not in ("channel", "tensor"):
            raise ValueError(f"compressed-tensors weight strategy {strategy!r} is not supported.")
    if len(strategies) > 1:
        raise ValueError(f"compressed-tensors groups mix weight strategies {sorted(strategies)}.")
    return block, (strategies.pop() if strategies else "tensor")


class CompressedTensorsFp8Quantizer(Quantizer):
    """``quant_method: compressed-tensors`` in ``float-quantized``: ``weight`` (e4m3) and
    ``weight_scale`` (float32 per channel [out, 1], per tensor, per block or per group);
    ``input_scale`` is left out by the loader (activations are quantized dynamically). Other
    compressed-tensors formats are declined (and dequantized by the engine where it can)."""

    name: ClassVar[str] = "compressed-tensors/float-quantized"
    # the CPU computes its layers with the platform's fp8_linear (engine-cpu's kernel)
    supported_platforms: ClassVar[frozenset[str] | None] = frozenset({"cuda", "cpu"})
    activation_dtypes: ClassVar[frozenset[str]] = frozenset({"bfloat16", "float16", "float32"})
    error_bound: float = 0.05  # as fp8's: the same e4m3 elements

    def __init__(self, block: tuple[int, int] | None, skips: Skips) -> None:
        self.block = block
        self.skips = skips

    @classmethod
    def declines(cls, quantization_config: dict[str, Any]) -> str | None:
        return declines_other_formats(quantization_config, FLOAT_FORMAT)

    @classmethod
    def from_config(cls, quantization_config: dict[str, Any], *, prequantized: bool) -> CompressedTensorsFp8Quantizer:
        if not prequantized:
            raise ValueError("compressed-tensors describes prequantized checkpoints; use --quantization fp8.")
        declined = cls.declines(quantization_config)
        if declined is not None:
            raise ValueError(f"compressed-tensors checkpoint not served here: {declined}.")
        block, _ = float_weight_layout(quantization_config)
        return cls(block, Skips(_names(quantization_config, "ignore")))

    def get_linear_method(self, layer_name: str) -> LinearMethod | None:
        if self.skips(layer_name):
            return None
        return Fp8LinearMethod(self.block, "weight_scale", prequantized=True)

    def get_experts_method(self, layer_name: str) -> ExpertsMethod | None:
        if self.skips(layer_name):
            return None
        return Fp8ExpertsMethod(self.block, prequantized=True)


def write_fp8_checkpoint(path, dense_path, block: tuple[int, int] = DEFAULT_BLOCK, suffixes=("proj.weight",)) -> None:
    """Rewrite the one-file safetensors checkpoint at ``path`` in DeepSeek's FP8 layout: every
    weight whose name ends with one of ``suffixes`` in e4m3 with ``weight_scale_inv`` per
    ``block``, and ``quantization_config`` in its config; a copy at ``dense_path`` holds the
    weights they stand for (the reference a test or ``scripts/gpu_check.py`` compares with)."""
    import json
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    path, dense_path = Path(path), Path(dense_path)
    tensors = load_file(str(path / "model.safetensors"))
    shutil.copytree(path, dense_path)
    out, dense = {}, dict(tensors)
    for name, tensor in tensors.items():
        if name.endswith(tuple(suffixes)) and tensor.dim() == 2:
            q, scales = quantize_fp8_blocks(tensor, block)
            out[name], out[name.removesuffix(".weight") + ".weight_scale_inv"] = q, scales
            rows = per_row_scales(name, scales, q.shape[0], q.shape[1], block)
            dense[name] = q.float() * rows.repeat_interleave(block[1], dim=1)[:, : q.shape[1]]
        else:
            out[name] = tensor
    save_file(out, str(path / "model.safetensors"))
    save_file(dense, str(dense_path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block)}
    (path / "config.json").write_text(json.dumps(config))
