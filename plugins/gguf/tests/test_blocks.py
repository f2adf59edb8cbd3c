"""GGUF blocks converted to the group-quantized layout against the ``gguf`` package's own numpy
dequantization: the same float32 values, bit for bit, for blocks of random bytes (every bit
pattern a block may hold, with finite float16 scales) and for blocks the repository's
round-to-nearest writer makes from a weight (which must come back close to that weight)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from engine.model_loader.gguf_quantize import quantize_blocks
from engine_gguf.blocks import BLOCKS, to_group_quant

ROWS, INPUTS = 6, 512
# where each type's float16 fields lie in its block (byte offsets)
F16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
# storage bits and inputs a group in the layout (the module docstring's table)
# type -> (storage bits, group size, groups a super-block)
LAYOUTS = {"Q8_0": (8, 32, 0), "Q4_0": (4, 32, 0), "Q4_K": (4, 32, 8), "Q5_K": (6, 32, 8), "Q6_K": (6, 16, 16)}
# largest |error| / max |weight| of round-to-nearest on Gaussian rows
WRITER_ERRORS = {"Q8_0": 0.006, "Q6_K": 0.03, "Q5_K": 0.05, "Q4_K": 0.1, "Q4_0": 0.12}


def random_blocks(kind: str, seed: int) -> np.ndarray:
    """Random bytes for every field, then random finite float16 values in the scale fields."""
    rng = np.random.default_rng(seed)
    block, nbytes = BLOCKS[kind]
    raw = rng.integers(0, 256, (ROWS, INPUTS // block, nbytes), dtype=np.uint8)
    for offset in F16_FIELDS[kind]:
        scale = (rng.standard_normal(raw.shape[:2]) * 0.01).astype(np.float16)
        raw[..., offset : offset + 2] = scale[..., None].view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(ROWS, -1)


def reference(kind: str, raw: np.ndarray) -> np.ndarray:
    return gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, kind))


@pytest.mark.parametrize("kind", list(BLOCKS))
def test_random_blocks_convert_exactly(kind):
    for seed in range(3):
        raw = random_blocks(kind, seed)
        weight = to_group_quant(kind, torch.from_numpy(raw), INPUTS)
        assert (weight.bits, weight.group_size, weight.super_group) == LAYOUTS[kind]
        want = reference(kind, raw)
        assert np.isfinite(want).all()
        assert np.array_equal(weight.dequantize().numpy(), want), f"{kind}, seed {seed}"


@pytest.mark.parametrize("kind", list(BLOCKS))
def test_written_blocks_are_valid_and_convert_exactly(kind):
    rng = np.random.default_rng(1)
    dense = (rng.standard_normal((ROWS, INPUTS)) * rng.uniform(0.01, 3.0, (ROWS, 1))).astype(np.float32)
    dense[0, : INPUTS // 2] = 0  # an all-zero block
    raw = quantize_blocks(dense, kind)
    block, nbytes = BLOCKS[kind]
    assert raw.dtype == np.uint8 and raw.shape == (ROWS, INPUTS // block * nbytes)
    want = reference(kind, raw)
    error = np.abs(want - dense).max(axis=1) / np.abs(dense).max(axis=1)
    assert error.max() <= WRITER_ERRORS[kind], f"{kind}: round-to-nearest error {error.max():.4f}"
    assert np.array_equal(want[0, : INPUTS // 2], np.zeros(INPUTS // 2, np.float32))
    weight = to_group_quant(kind, torch.from_numpy(raw), INPUTS)
    assert np.array_equal(weight.dequantize().numpy(), want)


def test_q8_0_matches_the_format_written_plainly():
    """Q8_0, by hand: a float16 d then 32 int8 values, x = d * q."""
    d = np.float16(0.125)
    q = np.arange(-16, 16, dtype=np.int8)
    raw = np.concatenate([np.frombuffer(d.tobytes(), np.uint8), q.view(np.uint8)])[None, :]
    weight = to_group_quant("Q8_0", torch.from_numpy(raw), 32)
    assert np.array_equal(weight.dequantize().numpy()[0], q.astype(np.float32) * 0.125)


def test_a_mis_sized_row_names_its_shape():
    with pytest.raises(ValueError, match=r"Q4_K blocks of 512 inputs a row are uint8 \[2, 288\].*got \(2, 144\)"):
        to_group_quant("Q4_K", torch.zeros(2, 144, dtype=torch.uint8), 512)
    with pytest.raises(ValueError, match="GGUF type Q2_K; engine-gguf converts Q8_0, Q4_0, Q4_K, Q5_K, Q6_K"):
        to_group_quant("Q2_K", torch.zeros(2, 84, dtype=torch.uint8), 256)
