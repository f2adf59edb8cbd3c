"""Compute-capability rules, written out per device generation."""

from __future__ import annotations

import pytest

from engine_cuda.capability import CudaCapability, architecture_name


@pytest.mark.parametrize(
    "major, minor, architecture, supported, bf16, fp8",
    [
        (7, 0, "Volta", False, False, False),
        (7, 5, "Turing", True, False, False),
        (8, 0, "Ampere", True, True, False),
        (8, 6, "Ampere", True, True, False),
        (8, 9, "Ada Lovelace", True, True, True),
        (9, 0, "Hopper", True, True, True),
        (10, 0, "Blackwell", True, True, True),
        (12, 0, "Blackwell", True, True, True),
        (13, 0, "unknown architecture", True, True, True),  # newer than the table: the newest rules
    ],
)
def test_rules_by_compute_capability(major, minor, architecture, supported, bf16, fp8):
    c = CudaCapability(major, minor)
    assert architecture_name(major, minor) == c.architecture == architecture
    assert (c.supported, c.has_bf16, c.has_fp8) == (supported, bf16, fp8)
    assert c.sm == f"sm_{major}{minor}"
    assert c.dtypes == (("float32", "bfloat16", "float16") if bf16 else ("float32", "float16"))
    assert c.default_dtype == ("bfloat16" if bf16 else "float16")
    assert c.fp8_dtype == ("float8_e4m3fn" if fp8 else None)
    assert c.describe() == f"compute capability {major}.{minor}, {architecture}"
