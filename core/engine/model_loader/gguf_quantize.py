"""Round-to-nearest GGUF block quantizers (numpy): the rows of a weight [N, K] as llama.cpp's
``Q8_0``, ``Q4_0``, ``Q4_K``, ``Q5_K`` and ``Q6_K`` blocks, for quantized GGUFs that tests and
``engine bench`` write.

Each row is cut into blocks of ``block_size`` inputs (32 for the ``_0`` types, 256 for the
k-quants); a block's bytes, as ``ggml-common.h`` lays them out:

- ``Q8_0`` (34 bytes): ``d`` (f16), 32 int8 ``q``; ``x = d * q``.
- ``Q4_0`` (18 bytes): ``d`` (f16), 16 bytes of nibbles: byte ``j`` holds input ``j`` low and
  ``j + 16`` high; ``x = d * (q - 8)``.
- ``Q4_K`` (144 bytes): ``d``, ``dmin`` (f16), 12 bytes of eight 6-bit scales ``sc`` and mins
  ``m`` (bytes 0-3: ``sc[j]`` in bits 0-5, bits 4-5 of ``sc[j + 4]`` in bits 6-7; bytes 4-7 the
  same for ``m``; bytes 8-11: the low nibbles of ``sc[j + 4]`` and ``m[j + 4]``), then 128 bytes
  of nibbles: byte ``32 c + l`` holds input ``64 c + l`` low and ``64 c + 32 + l`` high;
  ``x = d * sc[i // 32] * q - dmin * m[i // 32]``.
- ``Q5_K`` (176 bytes): as ``Q4_K`` with 32 bytes ``qh`` before the nibbles: bit ``j`` of
  ``qh[l]`` is bit 4 of input ``32 j + l``; ``q`` in [0, 32).
- ``Q6_K`` (210 bytes): 128 bytes ``ql`` (byte ``64 h + l``: low nibbles of inputs ``128 h + l``
  low and ``128 h + 64 + l`` high), 64 bytes ``qh`` (bits ``2 t, 2 t + 1`` of byte ``32 h + l``:
  bits 4-5 of input ``128 h + 32 t + l``), sixteen int8 scales, ``d`` (f16);
  ``x = d * sc[i // 16] * (q - 32)``.

``Q8_0`` and ``Q4_0`` are the ``gguf`` package's own quantizers (bit-exact with llama.cpp's
reference); the k-quants pick each sub-block's scale and min from its range, then the
block's ``d`` / ``dmin`` from the largest of them (llama.cpp searches for better ones: these
blocks are valid, only a little less accurate).
"""

from __future__ import annotations

import numpy as np

QK_K = 256
BLOCK_SIZES = {"Q8_0": 32, "Q4_0": 32, "Q4_K": QK_K, "Q5_K": QK_K, "Q6_K": QK_K}
QUANT_TYPES = tuple(BLOCK_SIZES)


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    """[B] float -> [B, 2] uint8, the f16 bits little-endian."""
    return values.astype("<f2").reshape(-1, 1).view(np.uint8)


def _blocks(weight: np.ndarray, block: int) -> np.ndarray:
    rows, cols = weight.shape
    if cols % block:
        raise ValueError(f"A row of {cols} inputs does not split into GGUF blocks of {block}.")
    return np.ascontiguousarray(weight, dtype=np.float32).reshape(-1, block)


def _scale_mins(x: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Sub-blocks x [B, 8, 32] -> the block's ``d``, ``dmin`` (rounded to f16) and the 6-bit
    ``sc``, ``m`` [B, 8] of an asymmetric ``levels``-level quantization."""
    lo = np.minimum(x.min(axis=-1), 0.0)
    hi = np.maximum(x.max(axis=-1), 0.0)
    scale = (hi - lo) / (levels - 1)
    mins = -lo
    d = (scale.max(axis=-1) / 63).astype(np.float16).astype(np.float32)
    dmin = (mins.max(axis=-1) / 63).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.rint(scale / d[:, None]), 0).clip(0, 63).astype(np.uint8)
        m = np.where(dmin[:, None] > 0, np.rint(mins / dmin[:, None]), 0).clip(0, 63).astype(np.uint8)
    return d, dmin, sc, m


def _quantize_asymmetric(x: np.ndarray, d, dmin, sc, m, levels: int) -> np.ndarray:
    """x [B, 8, 32] -> q [B, 8, 32] uint8 in [0, levels) under ``d * sc * q - dmin * m``."""
    step = d[:, None] * sc.astype(np.float32)  # [B, 8]
    shift = dmin[:, None] * m.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step[..., None] > 0, np.rint((x + shift[..., None]) / step[..., None]), 0)
    return q.clip(0, levels - 1).astype(np.uint8)


def _pack_scale_mins(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """sc, m [B, 8] 6-bit -> [B, 12] bytes (the ``Q4_K`` / ``Q5_K`` scale layout)."""
    low_sc = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    low_m = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    high = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    return np.concatenate([low_sc, low_m, high], axis=1).astype(np.uint8)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """q [B, 256] (low 4 bits used) -> [B, 128] bytes: byte ``32 c + l`` holds ``64 c + l`` low
    and ``64 c + 32 + l`` high."""
    q = (q & 0x0F).reshape(-1, 4, 2, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)


def quantize_q4_k(weight: np.ndarray) -> np.ndarray:
    x = _blocks(weight, QK_K).reshape(-1, 8, 32)
    d, dmin, sc, m = _scale_mins(x, 16)
    q = _quantize_asymmetric(x, d, dmin, sc, m, 16).reshape(-1, QK_K)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_scale_mins(sc, m), _nibbles(q)], axis=1)


def quantize_q5_k(weight: np.ndarray) -> np.ndarray:
    x = _blocks(weight, QK_K).reshape(-1, 8, 32)
    d, dmin, sc, m = _scale_mins(x, 32)
    q = _quantize_asymmetric(x, d, dmin, sc, m, 32)  # [B, 8, 32]
    bits = (q >> 4) & 1
    qh = (bits << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1, dtype=np.uint8)  # [B, 32]
    return np.concatenate(
        [_f16_bytes(d), _f16_bytes(dmin), _pack_scale_mins(sc, m), qh, _nibbles(q.reshape(-1, QK_K))], axis=1
    )


def quantize_q6_k(weight: np.ndarray) -> np.ndarray:
    x = _blocks(weight, QK_K).reshape(-1, 16, 16)
    amax = np.abs(x).max(axis=-1)  # [B, 16]
    scale = amax / 31  # q - 32 in [-31, 31]
    d = (scale.max(axis=-1) / 127).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.rint(scale / d[:, None]), 0).clip(-127, 127).astype(np.int8)
        step = d[:, None] * sc.astype(np.float32)
        q = np.where(step[..., None] > 0, np.rint(x / step[..., None]), 0)
    q = (q.clip(-32, 31) + 32).astype(np.uint8).reshape(-1, QK_K)
    halves = q.reshape(-1, 2, 2, 64)  # [B, h, s, l]: input 128 h + 64 s + l
    ql = ((halves[:, :, 0] & 0x0F) | ((halves[:, :, 1] & 0x0F) << 4)).reshape(-1, 128)
    quarters = (q.reshape(-1, 2, 4, 32) >> 4) & 0x03  # [B, h, t, l]: input 128 h + 32 t + l
    qh = (quarters << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(axis=2, dtype=np.uint8)
    return np.concatenate([ql, qh.reshape(-1, 64), sc.view(np.uint8), _f16_bytes(d)], axis=1)


def quantize_blocks(weight: np.ndarray, quant_type: str) -> np.ndarray:
    """A float weight [N, K] as ``quant_type`` blocks: uint8 [N, K / block_size * block_bytes],
    the layout ``gguf.GGUFWriter.add_tensor(..., raw_dtype=...)`` takes."""
    import gguf

    if quant_type not in BLOCK_SIZES:
        raise ValueError(f"GGUF quantization {quant_type!r} is not written here; known: {', '.join(QUANT_TYPES)}.")
    weight = np.asarray(weight, dtype=np.float32)
    rows = weight.shape[0]
    if quant_type in ("Q8_0", "Q4_0"):
        _blocks(weight, BLOCK_SIZES[quant_type])  # the same error for a row that does not split
        return gguf.quants.quantize(weight, getattr(gguf.GGMLQuantizationType, quant_type))
    blocks = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}[quant_type](weight)
    return blocks.reshape(rows, -1)
