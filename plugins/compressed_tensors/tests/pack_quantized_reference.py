"""The pack-quantized format written out plainly (numpy bit arithmetic), and a
quantization_config as llm-compressor writes it: the tests' independent reference."""

from __future__ import annotations

import numpy as np


def config(bits: int, strategy: str, symmetric: bool, group_size: int | None = None, **group) -> dict:
    """A quantization_config as llm-compressor writes it for a weight-only scheme."""
    weights = {"num_bits": bits, "type": "int", "strategy": strategy, "symmetric": symmetric, "dynamic": False}
    if group_size is not None:
        weights["group_size"] = group_size
    scheme = {"format": "pack-quantized", "targets": ["Linear"], "weights": weights, "input_activations": None}
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": {**scheme, **group}},
        "ignore": ["lm_head"],
    }


def unpack_reference(words: np.ndarray, bits: int, size: int, axis: int = 1) -> np.ndarray:
    """Stored (offset) values: value ``i`` of word ``j`` along ``axis`` is bits ``[bits i, bits (i + 1))``."""
    words = words.astype(np.int64) & 0xFFFFFFFF  # the word's 32 bits, unsigned
    if axis == 0:
        return unpack_reference(words.T, bits, size).T
    per_word = 32 // bits
    rows, columns = words.shape
    out = np.zeros((rows, columns * per_word), dtype=np.int64)
    for j in range(columns):
        for i in range(per_word):
            out[:, j * per_word + i] = (words[:, j] >> (bits * i)) & ((1 << bits) - 1)
    return out[:, :size]


def dequantize_reference(tensors: dict, bits: int) -> np.ndarray:
    """W[n, k] = scale[n, k // g] * (q[n, k] - z[n, k // g]), q and z signed."""
    n, k = (int(v) for v in tensors["weight_shape"])
    offset = 1 << (bits - 1)
    q = unpack_reference(tensors["weight_packed"].numpy(), bits, k) - offset
    scale = tensors["weight_scale"].float().numpy().astype(np.float64)
    if "weight_zero_point" in tensors:
        zero = unpack_reference(tensors["weight_zero_point"].numpy(), bits, n, axis=0) - offset
    else:
        zero = np.zeros(scale.shape, dtype=np.int64)
    group = k // scale.shape[1]
    return np.repeat(scale, group, axis=1) * (q - np.repeat(zero, group, axis=1))
