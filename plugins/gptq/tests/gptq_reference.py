"""The GPTQ checkpoint format, written out plainly with numpy bit arithmetic (independent of
the plugin's torch code), for a linear module of weight W [N, K] quantized to ``bits`` bits:

- ``pack = 32 // bits`` values share one int32 word, the first in the lowest bits;
- ``qweight`` int32 [K / pack, N]: q[k, n] = (qweight[k // pack, n] >> (bits * (k % pack))) & mask;
- ``qzeros`` int32 [G, N / pack]: packed the same way along the outputs,
  zq[g, n] = (qzeros[g, n // pack] >> (bits * (n % pack))) & mask; the zero is zq + 1 in
  the classic format (``checkpoint_format: gptq``) and zq in ``gptq_v2``;
- ``scales`` float16 [G, N]; ``g_idx`` int32 [K], the group of input row k;
- W[n, k] = scales[g_idx[k], n] * (q[k, n] - zero[g_idx[k], n]).
"""

from __future__ import annotations

import numpy as np


def pack_words(values: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """Integers in [0, 2**bits) -> int32 words holding ``32 // bits`` consecutive values along ``axis``."""
    pack = 32 // bits
    moved = np.moveaxis(values.astype(np.uint64), axis, -1)
    grouped = moved.reshape(*moved.shape[:-1], moved.shape[-1] // pack, pack)
    words = np.zeros(grouped.shape[:-1], dtype=np.uint64)
    for i in range(pack):
        words |= grouped[..., i] << np.uint64(bits * i)
    return np.moveaxis(words.astype(np.uint32).view(np.int32), -1, axis)


def unpack_words(words: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """The inverse of :func:`pack_words`, as int64 values."""
    pack = 32 // bits
    unsigned = np.moveaxis(words.view(np.uint32).astype(np.uint64), axis, -1)
    values = np.stack([(unsigned >> np.uint64(bits * i)) & np.uint64((1 << bits) - 1) for i in range(pack)], -1)
    return np.moveaxis(values.reshape(*unsigned.shape[:-1], -1).astype(np.int64), -1, axis)


def dequantize(tensors: dict, bits: int, checkpoint_format: str = "gptq") -> np.ndarray:
    """W [N, K] float64 from one module's GPTQ tensors (numpy arrays)."""
    q = unpack_words(tensors["qweight"], bits, axis=0)  # [K, N]
    zeros = unpack_words(tensors["qzeros"], bits, axis=1)  # [G, N]
    if checkpoint_format == "gptq":
        zeros = zeros + 1
    g_idx = tensors["g_idx"].astype(np.int64)
    scales = tensors["scales"].astype(np.float64)
    return (scales[g_idx] * (q - zeros[g_idx])).T


def random_module(
    rng: np.random.Generator,
    inputs: int,
    outputs: int,
    bits: int,
    group_size: int,
    sym: bool,
    act_order: bool,
    fmt: str,
) -> dict:
    """GPTQ tensors of random integers, scales and (with act-order) a shuffled g_idx."""
    maxq = (1 << bits) - 1
    size = inputs if group_size == -1 else group_size
    groups = -(-inputs // size)
    g_idx = np.arange(inputs) // size
    if act_order:
        g_idx = rng.permutation(g_idx)
    q = rng.integers(0, maxq + 1, size=(inputs, outputs))
    if sym:
        zeros = np.full((groups, outputs), (maxq + 1) // 2)
    else:
        zeros = rng.integers(1 if fmt == "gptq" else 0, maxq + 1, size=(groups, outputs))
    stored = zeros - 1 if fmt == "gptq" else zeros
    scales = (rng.uniform(0.5, 1.5, size=(groups, outputs)) / maxq / inputs**0.5).astype(np.float16)
    return {
        "qweight": pack_words(q, bits, axis=0),
        "qzeros": pack_words(stored, bits, axis=1),
        "scales": scales,
        "g_idx": g_idx.astype(np.int32),
    }
