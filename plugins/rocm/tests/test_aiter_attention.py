"""engine-rocm's ``aiter_mha`` backend through the attention kit, with ``aiter`` replaced by
a plain torch implementation of ``flash_attn_varlen_func`` as AITER documents it (packed
varlen batch, GQA by head groups, causal mask aligned to the bottom right, ``window_size``
left/right in keys). What runs for real is the backend: cache writes, the gather of each
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
from engine_rocm.aiter_attention import AiterPagedAttention


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    **unused,
):
    """flash-attn's varlen forward, one sequence at a time."""
    assert dropout_p == 0.0 and not unused
    assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
    assert k.shape[0] == v.shape[0] == int(cu_seqlens_k[-1]) and q.shape[0] == int(cu_seqlens_q[-1])
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype)
    group = q.shape[1] // k.shape[1]
    for i in range(cu_seqlens_q.shape[0] - 1):
        qs, qe, ks, ke = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1]), int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        assert qe - qs <= max_seqlen_q and ke - ks <= max_seqlen_k
        qi = q[qs:qe].float().transpose(0, 1)  # [H, Lq, D]
        ki = k[ks:ke].float().repeat_interleave(group, 1).transpose(0, 1)
        vi = v[ks:ke].float().repeat_interleave(group, 1).transpose(0, 1)
        scores = scale * qi @ ki.transpose(1, 2)  # [H, Lq, Lk]
        row = torch.arange(qe - qs)[:, None] + (ke - ks) - (qe - qs)  # the key index the row aligns to
        key = torch.arange(ke - ks)[None, :]
        allowed = torch.ones_like(scores[0], dtype=torch.bool)
        if causal or window_size[1] >= 0:
            allowed &= key <= row + (0 if causal else window_size[1])
        if window_size[0] >= 0:
            allowed &= key >= row - window_size[0]
        weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
        out[qs:qe] = (weights @ vi).transpose(0, 1).to(q.dtype)
    return out


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
