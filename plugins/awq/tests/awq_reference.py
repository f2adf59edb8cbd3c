"""The AWQ GEMM checkpoint format (AutoAWQ ``version: gemm``), written out plainly with numpy
bit arithmetic (independent of the plugin's torch code), for a linear module of weight W [N, K]
quantized to 4 bits in groups of ``g`` inputs:

- eight 4-bit values share one int32 word, packed along the OUTPUT dim in AWQ's interleaved
  order: nibble i (bits 4 i .. 4 i + 3) of word j holds output 8 j + ORDER[i], with
  ORDER = [0, 2, 4, 6, 1, 3, 5, 7];
- ``qweight`` int32 [K, N / 8]: q[k, n] = (qweight[k, n // 8] >> (4 * i)) & 15 for the i with
  ORDER[i] == n % 8;
- ``qzeros`` int32 [K / g, N / 8]: z[k // g, n], packed the same way;
- ``scales`` float16 [K / g, N];
- W[n, k] = (q[k, n] - z[k // g, n]) * scales[k // g, n].
"""

from __future__ import annotations

import numpy as np

ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def pack_words(values: np.ndarray) -> np.ndarray:
    """[R, N] integers in [0, 16) -> [R, N / 8] int32 words in AWQ's order."""
    rows, outputs = values.shape
    words = np.zeros((rows, outputs // 8), dtype=np.uint64)
    for j in range(outputs // 8):
        for i in range(8):
            words[:, j] |= values[:, 8 * j + ORDER[i]].astype(np.uint64) << np.uint64(4 * i)
    return words.astype(np.uint32).view(np.int32)


def unpack_words(words: np.ndarray) -> np.ndarray:
    """The inverse of :func:`pack_words`, as int64 values [R, 8 C]."""
    unsigned = words.view(np.uint32).astype(np.uint64)
    values = np.zeros((words.shape[0], words.shape[1] * 8), dtype=np.int64)
    for j in range(words.shape[1]):
        for i in range(8):
            values[:, 8 * j + ORDER[i]] = (unsigned[:, j] >> np.uint64(4 * i)) & np.uint64(15)
    return values


def dequantize(tensors: dict, group_size: int) -> np.ndarray:
    """W [N, K] float64 from one module's AWQ tensors (numpy arrays)."""
    q = unpack_words(tensors["qweight"])  # [K, N]
    zeros = unpack_words(tensors["qzeros"])  # [G, N]
    scales = tensors["scales"].astype(np.float64)
    size = q.shape[0] if group_size == -1 else group_size
    group = np.arange(q.shape[0]) // size  # the group of each input k
    return ((q - zeros[group]) * scales[group]).T


def random_module(rng: np.random.Generator, inputs: int, outputs: int, group_size: int) -> dict:
    """AWQ tensors of random integers, zeros and scales."""
    groups = 1 if group_size == -1 else inputs // group_size
    q = rng.integers(0, 16, size=(inputs, outputs))
    zeros = rng.integers(0, 16, size=(groups, outputs))
    scales = (rng.uniform(0.5, 1.5, size=(groups, outputs)) / 15 / inputs**0.5).astype(np.float16)
    return {"qweight": pack_words(q), "qzeros": pack_words(zeros), "scales": scales}
