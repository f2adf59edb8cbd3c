"""The gfx architecture table: feature flags stripped, family and FP8 format per target."""

from __future__ import annotations

import pytest
import torch

from engine_rocm.arch import ARCH_TABLE, arch_capabilities, fp8_capable_archs, gfx_arch, is_fp8_method


@pytest.mark.parametrize(
    "gcn_arch_name, arch, family, fp8_dtype",
    [
        ("gfx942:sramecc+:xnack-", "gfx942", "CDNA3", "float8_e4m3fnuz"),  # MI300X
        ("gfx950:sramecc+:xnack-", "gfx950", "CDNA4", "float8_e4m3fn"),  # MI355X
        ("gfx1200", "gfx1200", "RDNA4", "float8_e4m3fn"),  # RX 9060
        ("gfx1201", "gfx1201", "RDNA4", "float8_e4m3fn"),  # RX 9070
        ("gfx1100", "gfx1100", "RDNA3", None),  # RX 7900 XTX
        ("gfx1151", "gfx1151", "RDNA3", None),  # Strix Halo iGPU
        ("gfx90a:sramecc+:xnack-", "gfx90a", "CDNA2", None),  # MI250X
        ("gfx908:sramecc+:xnack-", "gfx908", "CDNA1", None),  # MI100
        ("gfx1030", "gfx1030", "RDNA1/RDNA2", None),  # RX 6900 XT
    ],
)
def test_known_architectures(gcn_arch_name, arch, family, fp8_dtype):
    caps = arch_capabilities(gcn_arch_name)
    assert (caps.arch, caps.family, caps.fp8_dtype) == (arch, family, fp8_dtype)
    assert caps.has_fp8 is (fp8_dtype is not None)


def test_fp8_formats_are_torch_dtypes():
    formats = {row.fp8_dtype for row in ARCH_TABLE if row.fp8_dtype is not None}
    assert formats == {"float8_e4m3fnuz", "float8_e4m3fn"}
    for name in formats:
        assert isinstance(getattr(torch, name), torch.dtype)


def test_gfx_arch_strips_feature_flags_and_case():
    assert gfx_arch("gfx942:sramecc+:xnack-") == "gfx942"
    assert gfx_arch(" GFX90A:xnack+ ") == "gfx90a"
    assert gfx_arch("gfx1201") == "gfx1201"


def test_unknown_and_missing_architectures_have_no_fp8():
    caps = arch_capabilities("gfx803")
    assert (caps.arch, caps.family, caps.fp8_dtype) == ("gfx803", "unknown", None)
    caps = arch_capabilities("")
    assert (caps.arch, caps.family, caps.fp8_dtype) == ("unknown", "unknown", None)
    # gfx94x engineering samples other than gfx942, and a prefix of a target, match nothing
    assert arch_capabilities("gfx9420").fp8_dtype is None


def test_fp8_capable_archs_lists_the_fp8_rows():
    assert fp8_capable_archs() == "gfx942, gfx950, gfx12xx"


@pytest.mark.parametrize(
    "method, fp8",
    [
        ("fp8", True),
        ("FP8", True),
        ("ptpc_fp8", True),
        ("fbgemm_fp8", True),
        ("bitsandbytes", False),
        ("awq", False),
        ("gptq", False),
        ("mxfp4", False),
    ],
)
def test_fp8_methods_are_recognised_by_name(method, fp8):
    assert is_fp8_method(method) is fp8
