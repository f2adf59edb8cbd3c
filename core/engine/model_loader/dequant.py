"""Low-precision checkpoint formats dequantized while they load, for platforms that have no
quantizer (no kernels) for them.

DeepSeek publishes its models in FP8 (``quantization_config.quant_method: "fp8"``):

- a quantized weight ``X.weight`` is ``float8_e4m3fn`` and comes with ``X.weight_scale_inv``
  (transformers' name) or ``X.scale`` (the reference checkpoints'), float32 or
  ``float8_e8m0fnu``, one factor per block of ``weight_block_size`` (default 128 × 128)
  of the weight's last two dims (a scalar: one for the whole tensor); the weight is the
  elements times their block's factor; per-tensor FP8 checkpoints (AutoFP8's, no
  ``weight_block_size``) name the factor ``X.weight_scale`` (one value, or [out, 1]);
- DeepSeek-V4's routed experts may be FP4 (``expert_dtype: "fp4"``): ``X.weight`` is int8
  (or uint8) holding two e2m1 values per byte, the element of even index in the low
  nibble, and ``X.scale`` one power-of-two factor (``float8_e8m0fnu``) per 32 elements of
  a row (MXFP4).

compressed-tensors checkpoints in MXFP4 (``quant_method: "compressed-tensors"``, format
``mxfp4-pack-quantized``, as Kimi-K3's routed experts ship) hold ``X.weight_packed`` (uint8,
the same packing: even element in the low nibble) and ``X.weight_scale`` (uint8 biased
exponents, ``2^(s - 127)``, one per 32 elements of a row); the layers the format leaves
alone keep a plain ``X.weight``.

gpt-oss ships its routed experts in MXFP4 too (``quant_method: "mxfp4"``): transformers'
stacked ``X`` (``experts.gate_up_proj``, ``experts.down_proj``) as ``X_blocks`` (uint8
[experts, out, groups, 16], the same packing, 32 values a group) and ``X_scales`` (uint8
biased exponents [experts, out, groups]); the dense tensor goes on under ``X`` in
transformers' layout for the unquantized checkpoint, [experts, in, out].

:func:`dequantize_stream` pairs each quantized weight with its scale, wherever in the
files either comes, and yields the dense weight in the model's dtype under ``X.weight``;
every other tensor passes through. A quantized weight whose scale never comes is an
error; a ``.scale`` tensor with no quantized weight of its prefix is an ordinary
parameter (a hyper-connection's ``scale``) and passes through at the end.

compressed-tensors checkpoints in FP8 (format ``float-quantized``, as the FP8 checkpoints of
Llama, Qwen and Mistral models ship) hold ``X.weight`` (``float8_e4m3fn``) and
``X.weight_scale`` (float32): one factor per output channel ([out, 1]), one for the whole
tensor ([1] or a scalar), one per ``block_structure`` block or one per ``group_size``
elements of a row. Their ``X.input_scale`` (a static activation scale) is dropped: dense
weights multiply unquantized activations, and FP8 kernels quantize activations as they run.

**Kept quantized.** When a quantization method with kernels for the format serves the
model's linear layers (engine-cuda's ``fp8`` on a GPU), ``keep_quantized=True``: each
quantized weight goes on as it is, under ``X.weight``, carrying its scale
(:mod:`engine.layers.quantized_checkpoint`); a linear layer whose method loads that scale
takes the pair, an experts method its experts' weights, and every other destination (MoE
experts without an experts method, a layer the method declined)
makes it dense with ``dense_tensor``, so a model's own loader need not know either way.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from engine.layers.quantized_checkpoint import FP8_TYPES, QUANTIZED_ATTR, QuantizedCheckpoint

MXFP4_FORMAT = "mxfp4-pack-quantized"
FLOAT_FORMAT = "float-quantized"
COMPRESSED_FORMATS = frozenset({MXFP4_FORMAT, FLOAT_FORMAT})
DROPPED_SUFFIXES = (".input_scale",)  # compressed-tensors' static activation scales
PACKED_FP4_TYPES = (torch.int8, torch.uint8)
SCALE_SUFFIXES = (".weight_scale_inv", ".scale", ".weight_scale")
# e2m1 code (sign bit 3, exponent bits 2-1, mantissa bit 0) -> value
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_GROUP = 32
GPT_OSS_MXFP4 = "mxfp4"  # gpt-oss's quant_method: experts as X_blocks and X_scales


def dequantizable(config: dict[str, Any]) -> bool:
    """Whether the engine can dequantize a checkpoint of this ``quantization_config`` at load."""
    method = config.get("quant_method")
    if method in ("fp8", GPT_OSS_MXFP4):
        return True
    return method == "compressed-tensors" and compressed_tensors_formats(config) <= COMPRESSED_FORMATS


def fp8_block_size(config: dict[str, Any]) -> tuple[int, int] | None:
    """An ``fp8`` quantization_config's ``weight_block_size`` (None: per tensor or channel),
    after checking its ``fmt`` is e4m3; a ValueError names what is unsupported."""
    fmt = config.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"fp8 checkpoints in fmt {fmt!r} are not supported (supported: e4m3).")
    block = config.get("weight_block_size")
    if block is not None and (len(block) != 2 or min(block) < 1):
        raise ValueError(f"weight_block_size must be two positive sizes, got {block!r}.")
    return (int(block[0]), int(block[1])) if block is not None else None


def _compressed_tensors_groups(config: dict[str, Any]) -> list[dict[str, Any]]:
    return [group for group in (config.get("config_groups") or {}).values() if isinstance(group, dict)]


def compressed_tensors_formats(config: dict[str, Any]) -> set[str]:
    """The formats a compressed-tensors ``quantization_config`` names: its config_groups', or else
    its top-level ``format`` (a set holding None when it names none)."""
    formats = {group.get("format") for group in _compressed_tensors_groups(config) if group.get("format")}
    return formats or {config.get("format")}


def declines_other_formats(config: dict[str, Any], served: str) -> str | None:
    """For a quantizer of one compressed-tensors format (``Quantizer.declines``): why it does not
    take ``config`` (another format, or several), or None."""
    formats = compressed_tensors_formats(config)
    if formats != {served}:
        return f"format {', '.join(sorted(map(str, formats)))}; it runs {served} only"
    return None


def _float_weight_layout(config: dict[str, Any]) -> tuple[tuple[int, int] | None, int | None]:
    """compressed-tensors FP8 weights' ``(block_structure, group_size)`` (either None)."""
    block, group = None, None
    for entry in _compressed_tensors_groups(config):
        weights = entry.get("weights") or {}
        if weights.get("block_structure"):
            block = tuple(int(b) for b in weights["block_structure"])
        if weights.get("group_size"):
            group = int(weights["group_size"])
    return block, group


class CheckpointDequantizer:
    """The settings of one checkpoint's ``quantization_config`` (``fp8``, or compressed-tensors
    in MXFP4)."""

    def __init__(self, config: dict[str, Any], dtype: torch.dtype, *, keep_quantized: bool = False) -> None:
        method = config.get("quant_method")
        if not dequantizable(config):
            raise ValueError(
                f"quant_method {method!r} (format {config.get('format')!r}) cannot be dequantized at "
                f"load (supported: fp8, {GPT_OSS_MXFP4}, compressed-tensors in {', '.join(sorted(COMPRESSED_FORMATS))})."
            )
        self.dtype = dtype
        self.keep_quantized = keep_quantized
        self.dequantized = 0  # weights made dense
        self.kept = 0  # weights passed on quantized, with their scales
        self.dropped = 0  # static activation scales left out
        self.compressed_tensors = method == "compressed-tensors"
        self.stacked_blocks = method == GPT_OSS_MXFP4
        # (quantized weight's suffix, the dtypes it comes in, its scales' suffixes)
        self.pairs: tuple[tuple[str, tuple[torch.dtype, ...], tuple[str, ...]], ...]
        if self.stacked_blocks:
            self.pairs = (("_blocks", (torch.uint8,), ("_scales",)),)
            self.block, self.float_block, self.float_group = (1, MXFP4_GROUP), None, None
            return
        if self.compressed_tensors:
            self.pairs = (
                (".weight_packed", PACKED_FP4_TYPES, (".weight_scale",)),
                (".weight", FP8_TYPES, (".weight_scale",)),
            )
            self.block = (1, MXFP4_GROUP)
            self.float_block, self.float_group = _float_weight_layout(config)
            return
        self.pairs = ((".weight", FP8_TYPES + PACKED_FP4_TYPES, SCALE_SUFFIXES),)
        # without a block size: a factor per tensor or per output channel (``weight_scale``)
        self.block = fp8_block_size(config)
        self.float_block, self.float_group = None, None

    @property
    def scale_suffixes(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(suffix for _, _, suffixes in self.pairs for suffix in suffixes))

    def scale_name(self, scale_suffix: str) -> str:
        """The name a layer loads a scale under: DeepSeek's ``.scale`` is transformers'
        ``weight_scale_inv``."""
        return "weight_scale_inv" if scale_suffix == ".scale" else scale_suffix[1:]

    def fp8_block(self, name: str, shape: torch.Size, scale: torch.Tensor) -> tuple[int, int]:
        """The block one scale covers of an FP8 weight of ``shape``."""
        if not self.compressed_tensors and self.block is not None:
            return self.block
        rows, cols = shape[-2], shape[-1]
        if tuple(scale.shape[-2:]) == (rows, 1):
            return (1, cols)  # per output channel
        if self.float_block is not None:
            return self.float_block
        if self.float_group is not None:
            return (1, self.float_group)
        if not self.compressed_tensors:
            return (128, 128)  # DeepSeek's blocks, when a config leaves weight_block_size out
        raise ValueError(
            f"{name}: FP8 weight {tuple(shape)} with scales {tuple(scale.shape)}: neither per channel, per "
            f"tensor, nor a block_structure / group_size the quantization_config names."
        )

    def dense_name(self, prefix: str) -> str:
        """The name a dense weight goes on under: ``X.weight``, or gpt-oss's stacked ``X``."""
        return prefix if self.stacked_blocks else prefix + ".weight"

    def dequantize(self, name: str, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The dense weight of ``name`` in the model's dtype."""
        if self.stacked_blocks:  # [E, out, groups, 16] -> rows of packed bytes -> [E, in, out]
            return self._dequantize_fp4(name, weight.flatten(-2), scale).transpose(-1, -2).contiguous()
        if weight.dtype in FP8_TYPES:
            values = weight.float()
            if scale.dim() == 0 or tuple(scale.shape) == (1,):  # one factor for the whole tensor
                return (values * scale.float().reshape(())).to(self.dtype)
            block = self.fp8_block(name, values.shape, scale)
            return (values * expand_block_scales(name, scale.float(), values.shape, block)).to(self.dtype)
        return self._dequantize_fp4(name, weight, scale)

    def _dequantize_fp4(self, name: str, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        codes = packed.view(torch.uint8)
        low, high = codes & 0x0F, codes >> 4
        table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
        values = torch.stack([table[low.long()], table[high.long()]], dim=-1).flatten(-2)  # [..., 2 · packed cols]
        groups = values.shape[-1] // MXFP4_GROUP
        if values.shape[-1] % MXFP4_GROUP or tuple(scale.shape) != (*values.shape[:-1], groups):
            raise ValueError(
                f"{name}: FP4 weight of {values.shape[-1]} values a row needs one scale per "
                f"{MXFP4_GROUP} of them, shape {(*values.shape[:-1], groups)}; the checkpoint has "
                f"{tuple(scale.shape)}."
            )
        exponents = scale.to(torch.int32) - 127 if scale.dtype == torch.uint8 else None  # compressed-tensors' e8m0
        factors = torch.exp2(exponents.float()) if exponents is not None else scale.float()
        factors = factors.repeat_interleave(MXFP4_GROUP, dim=-1)
        return (values * factors).to(self.dtype)


def expand_block_scales(
    name: str, scale: torch.Tensor, shape: torch.Size | tuple[int, ...], block: tuple[int, int]
) -> torch.Tensor:
    """One factor per ``block`` of the last two dims (the last block of each dim may be cut
    short) -> one per element of ``shape``; the wrong number of blocks is a ValueError."""
    rows, cols = shape[-2], shape[-1]
    block_rows, block_cols = block
    expected = (*shape[:-2], -(-rows // block_rows), -(-cols // block_cols))
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"{name}: a weight of shape {tuple(shape)} in blocks of {block} needs scales of "
            f"shape {expected}, the checkpoint has {tuple(scale.shape)}."
        )
    expanded = scale.repeat_interleave(block_rows, dim=-2)[..., :rows, :]
    return expanded.repeat_interleave(block_cols, dim=-1)[..., :cols]


def dequantize_stream(
    weights: Iterator[tuple[str, torch.Tensor]], dequantizer: CheckpointDequantizer
) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` with every quantized weight and its scale replaced by the dense weight (by the
    quantized weight carrying its scale, with ``keep_quantized``), static activation scales
    left out."""
    waiting_weights: dict[str, tuple[str, str, torch.Tensor]] = {}  # prefix -> (weight suffix, name, weight)
    waiting_scales: dict[str, tuple[str, str, torch.Tensor]] = {}  # prefix -> (name, suffix, scale)
    scale_suffixes = dequantizer.scale_suffixes

    def paired(prefix: str, weight_suffix: str, weight_name: str, weight: torch.Tensor, suffix: str, scale):
        if not dequantizer.keep_quantized:
            dequantizer.dequantized += 1
            return dequantizer.dense_name(prefix), dequantizer.dequantize(weight_name, weight, scale)
        setattr(
            weight,
            QUANTIZED_ATTR,
            QuantizedCheckpoint(weight_name, weight_suffix[1:], dequantizer.scale_name(suffix), scale, dequantizer),
        )
        dequantizer.kept += 1
        return prefix + ".weight", weight

    for name, tensor in weights:
        if name.endswith(DROPPED_SUFFIXES):
            dequantizer.dropped += 1
            continue
        scale_suffix = next((s for s in scale_suffixes if name.endswith(s)), None)
        if scale_suffix is not None:
            prefix = name[: -len(scale_suffix)]
            if prefix in waiting_weights:
                weight_suffix, weight_name, weight = waiting_weights.pop(prefix)
                yield paired(prefix, weight_suffix, weight_name, weight, scale_suffix, tensor)
            else:
                waiting_scales[prefix] = (name, scale_suffix, tensor)
            continue
        pair = next((p for p in dequantizer.pairs if name.endswith(p[0]) and tensor.dtype in p[1]), None)
        if pair is not None:
            prefix = name[: -len(pair[0])]
            if prefix in waiting_scales:
                _, suffix, scale = waiting_scales.pop(prefix)
                yield paired(prefix, pair[0], name, tensor, suffix, scale)
            else:
                waiting_weights[prefix] = (pair[0], name, tensor)
            continue
        yield name, tensor
    if waiting_weights:
        names = sorted(name for _, name, _ in waiting_weights.values())
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise ValueError(
            f"These quantized weights have no scale in the checkpoint "
            f"({' or '.join('X' + s for s in scale_suffixes)}): {shown}."
        )
    for name, _, tensor in waiting_scales.values():  # not a quantization scale: an ordinary tensor
        if name.endswith((".weight_scale_inv", ".weight_scale")):
            raise ValueError(f"{name} has no quantized weight beside it.")
        yield name, tensor
