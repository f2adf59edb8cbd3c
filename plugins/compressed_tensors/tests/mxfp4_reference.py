"""The OCP MX format's FP4 (e2m1) elements with e8m0 shared scales, as compressed-tensors'
``mxfp4-pack-quantized`` stores them, written out plainly: byte j of a row holds elements
2j (low nibble) and 2j + 1 (high nibble); a nibble is a sign bit (bit 3), two exponent bits
(bits 2-1, bias 1) and a mantissa bit (bit 0), subnormal when the exponent bits are 0; each run
of 32 elements of a row shares the factor 2^(s - 127) of its uint8 ``s`` in ``weight_scale``."""

from __future__ import annotations

import numpy as np


def e2m1(nibble: int) -> float:
    sign = -1.0 if nibble & 0b1000 else 1.0
    exponent, mantissa = (nibble >> 1) & 0b11, nibble & 1
    if exponent == 0:  # subnormal: 0 or 0.5
        return sign * 0.5 * mantissa
    return sign * 2.0 ** (exponent - 1) * (1 + 0.5 * mantissa)


def dequantize_reference(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """weight_packed [N, K / 2], weight_scale [N, K / 32] (uint8) -> the dense weight [N, K], float64."""
    rows, half = packed.shape
    out = np.empty((rows, 2 * half), dtype=np.float64)
    for n in range(rows):
        for j in range(half):
            byte = int(packed[n, j])
            for k, nibble in ((2 * j, byte & 0x0F), (2 * j + 1, byte >> 4)):
                out[n, k] = e2m1(nibble) * 2.0 ** (int(scale[n, k // 32]) - 127)
    return out
