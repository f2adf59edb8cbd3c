"""engine-rocm's ``aiter_mha`` backend through the attention kit, with ``aiter`` replaced by
a plain torch implementation of ``flash_attn_varlen_func`` as AITER documents it
(``engine.testing.oracles.flash_attn_varlen_func``: packed varlen batch, GQA by head groups,
causal mask aligned to the bottom right, ``window_size`` left/right in keys). What runs for real is the backend: cache writes, the gather of each
sequence's keys through its block table, and the arguments it hands to AITER."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch

from engine.interfaces.attention import MHA, AttentionSpec
from engine.plugins.manager import get_plugin_manager
from engine.testing.kit import AttentionBackendTests
from engine.testing.oracles import flash_attn_varlen_func
from engine_rocm.aiter_attention import AiterPagedAttention


@pytest.fixture
def fake_aiter(monkeypatch):
    module = types.ModuleType("aiter")
    module.flash_attn_varlen_func = flash_attn_varlen_func
    monkeypatch.setitem(sys.modules, "aiter", module)
    return module


def on_the_cpu(cls):
    return type(
        f"Cpu{cls.__name__}",
        (cls,),
        {
            "capabilities": dataclasses.replace(
                cls.capabilities, platforms=frozenset({"cpu"}), dtypes=frozenset({"float32", "bfloat16"})
            ),
        },
    )


@pytest.mark.usefixtures("fake_aiter")
class TestAiterMhaKit(AttentionBackendTests):
    """aiter_mha against the kit's naive oracle: MHA/GQA/MQA in decode, prefill after a cached
    prefix and mixed batches, sliding windows across block edges, cache writes."""

    plugin = "rocm"
    backend_name = "aiter_mha"
    dtypes = ("float32", "bfloat16")

    def backend_class(self):
        return on_the_cpu(AiterPagedAttention)


def spec() -> AttentionSpec:
    return AttentionSpec(kind=MHA, num_heads=4, num_kv_heads=2, head_size=16, scale=0.25)


def test_without_aiter_building_the_backend_says_what_to_do(monkeypatch):
    monkeypatch.setitem(sys.modules, "aiter", None)
    with pytest.raises(RuntimeError, match="needs AMD's aiter package.*--attention-backend triton_paged"):
        AiterPagedAttention(spec(), 16, torch.bfloat16, torch.device("cpu"))


def test_an_aiter_without_varlen_flash_attention_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "aiter", types.ModuleType("aiter"))
    with pytest.raises(RuntimeError, match="lacks; upgrade aiter"):
        AiterPagedAttention(spec(), 16, torch.bfloat16, torch.device("cpu"))


def test_registered_for_rocm_whether_or_not_aiter_is_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "aiter", None)
    capabilities = get_plugin_manager(["rocm"]).components().attention_backends.get("aiter_mha").capabilities
    assert capabilities.platforms == {"rocm"} and MHA in capabilities.kinds
