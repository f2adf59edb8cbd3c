"""GGUF quantized blocks -> the engine's group-quantized layout, exactly.

A GGUF weight [N, K] is stored row by row, each row ``K / block_size`` blocks (bytes as
``ggml-common.h`` lays them out; :mod:`engine.model_loader.gguf_quantize` writes them out). Each
type's dequantization is ``W = scale * q - offset`` per group of inputs, with ``q`` an
unsigned integer:

==========  =====  =================================  ==========================  ==============
type        group  q                                  scale                       offset
==========  =====  =================================  ==========================  ==============
``Q8_0``    32     int8 + 128                         ``d``                       ``128 d``
``Q4_0``    32     nibble                             ``d``                       ``8 d``
``Q4_K``    32     nibble                             ``d * sc``                  ``dmin * m``
``Q5_K``    32     nibble | bit of ``qh`` << 4        ``d * sc``                  ``dmin * m``
``Q6_K``    16     nibble of ``ql`` | 2 bits << 4     ``d * sc`` (``sc`` int8)    ``32 d sc``
==========  =====  =================================  ==========================  ==============

``d``, ``dmin`` are float16, ``sc``, ``m`` small integers: every scale and offset is exact in
float32, and so is ``scale * q`` (at most 24 significant bits), so the layout's
``scales * q - offsets`` rounds once where ``gguf.quants`` rounds once: the same float32
values. The k-quants keep their two levels (``GroupQuantWeight``'s ``super_group``): ``sc``
and ``m`` as int8 codes per group, ``d`` and ``dmin`` (``32 d`` for ``Q6_K``'s offset) as float32
per block of 256 inputs, so a ``Q4_K`` weight holds 4.75 bits an input, not 6. ``Q4_0`` and
``Q4_K`` values are stored 4 bits a value, ``Q5_K`` and ``Q6_K`` 6, ``Q8_0`` 8.
"""

from __future__ import annotations

import torch

from engine.interfaces.group_quant import GroupQuantWeight

QK_K = 256
# type -> (inputs a block, bytes a block)
BLOCKS = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_K": (QK_K, 144), "Q5_K": (QK_K, 176), "Q6_K": (QK_K, 210)}
TYPES = tuple(BLOCKS)


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 (little-endian f16 bits) -> [..., 1] float32."""
    return raw.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, chunk: int) -> torch.Tensor:
    """[..., bytes] uint8 -> [..., 2 * bytes]: each ``chunk`` of bytes gives ``chunk`` inputs from
    its low nibbles, then ``chunk`` from its high nibbles."""
    qs = qs.unflatten(-1, (-1, chunk))
    return torch.stack((qs & 0x0F, qs >> 4), dim=-2).flatten(-3)


def _scale_mins(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 scale bytes of a ``Q4_K`` / ``Q5_K`` block [..., 12] -> 6-bit ``sc``, ``m`` [..., 8]."""
    d, m, md = raw[..., 0:4], raw[..., 4:8], raw[..., 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mins = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc, mins


# each converter: a weight's blocks [N, blocks, bytes] -> (values [N, blocks, inputs], scales,
# offsets [N, blocks, groups a block], None) with float32 scales and offsets, or (values, codes,
# codes, (super scales, super offsets) [N, blocks, 1]) for two levels


def _q8_0(b: torch.Tensor):
    d = _f16(b[..., 0:2])  # [N, blocks, 1]
    q = b[..., 2:].contiguous().view(torch.int8).to(torch.int16) + 128
    return q, d, 128 * d, None


def _q4_0(b: torch.Tensor):
    d = _f16(b[..., 0:2])
    return _nibbles(b[..., 2:], 16), d, 8 * d, None


def _q4_k(b: torch.Tensor):
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, m = _scale_mins(b[..., 4:16])
    return _nibbles(b[..., 16:144], 32), sc, m, (d, dmin)


def _q5_k(b: torch.Tensor):
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, m = _scale_mins(b[..., 4:16])
    qh = b[..., 16:48]  # bit j of qh[l]: bit 4 of input 32 j + l
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device).unsqueeze(-1)
    high = ((qh.unsqueeze(-2) >> shifts) & 1).flatten(-2)
    return _nibbles(b[..., 48:176], 32) | (high << 4), sc, m, (d, dmin)


def _q6_k(b: torch.Tensor):
    low = _nibbles(b[..., 0:128], 64)  # byte 64 h + l: inputs 128 h + l (low), 128 h + 64 + l (high)
    qh = b[..., 128:192].unflatten(-1, (2, 1, 32))  # bits 2t of byte 32 h + l: input 128 h + 32 t + l
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).unsqueeze(-1)
    high = ((qh >> shifts) & 0x03).flatten(-3)
    sc = b[..., 192:208].contiguous().view(torch.int8)
    d = _f16(b[..., 208:210])
    return low | (high << 4), sc, sc, (d, 32 * d)


CONVERTERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}
VALUE_BITS = {"Q8_0": 8, "Q4_0": 4, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6}


def to_group_quant(kind: str, raw: torch.Tensor, in_features: int, *, what: str = "A GGUF weight") -> GroupQuantWeight:
    """A ``kind`` weight of ``in_features`` inputs, its blocks ``raw`` uint8 [N, bytes a row], as
    a :class:`GroupQuantWeight` with the same float32 values as ``gguf.quants.dequantize``."""
    if kind not in BLOCKS:
        raise ValueError(f"{what} is of GGUF type {kind}; engine-gguf converts {', '.join(TYPES)}.")
    block, nbytes = BLOCKS[kind]
    rows = raw.shape[0]
    if in_features % block or raw.dtype != torch.uint8 or tuple(raw.shape) != (rows, in_features // block * nbytes):
        raise ValueError(
            f"{what}: {kind} blocks of {in_features} inputs a row are uint8 [{rows}, "
            f"{in_features // block * nbytes}] ({block} inputs in {nbytes} bytes a block); got "
            f"{tuple(raw.shape)} {raw.dtype}."
        )
    q, scales, offsets, supers = CONVERTERS[kind](raw.reshape(rows, -1, nbytes))
    values = q.reshape(rows, in_features)
    bits = VALUE_BITS[kind]
    if supers is None:
        return GroupQuantWeight.from_values(values, scales.reshape(rows, -1), offsets.reshape(rows, -1), bits)
    return GroupQuantWeight.from_values(
        values,
        scales.reshape(rows, -1),
        offsets.reshape(rows, -1),
        bits,
        super_scales=supers[0].reshape(rows, -1),
        super_offsets=supers[1].reshape(rows, -1),
    )
