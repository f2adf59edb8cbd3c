"""The Triton paged-attention kernel (engine.kernels.paged_attention) under the Triton
interpreter: the triton_paged and triton_mla backends through the attention kit's checks
against its naive oracles, on a subset of the kit's cases (the interpreter runs every program
of the grid in Python)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined: run them on the CPU

import dataclasses  # noqa: E402

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from engine.kernels.paged_attention import TritonMlaAttention, TritonPagedAttention  # noqa: E402
from engine.testing.kit import AttentionBackendTests  # noqa: E402
from engine.testing.kit.attention import BATCHES, MLA, MLA_SIZES  # noqa: E402


def on_the_cpu(cls):
    """The backend on the CPU, through the Triton interpreter (float32)."""
    return type(f"Interpreted{cls.__name__}", (cls,), {
        "capabilities": dataclasses.replace(cls.capabilities, platforms=frozenset({"cpu"}),
                                            dtypes=frozenset({"float32"})),
    })


class TestTritonPagedKit(AttentionBackendTests):
    """triton_paged: full causal MHA/GQA/MQA in decode, prefill-after-prefix and mixed ragged
    batches, sliding windows across block edges, cache writes; one block size (4, so that
    sequences span many blocks) per case."""

    plugin = "cpu"
    backend_name = "triton_paged"
    dtypes = ("float32",)

    def backend_class(self):
        return on_the_cpu(TritonPagedAttention)

    @pytest.mark.parametrize("batch", BATCHES)
    @pytest.mark.parametrize("heads", ["gqa4", "mqa"])
    def test_mha(self, batch, heads, dtype, engine_device):
        self.check_random_case("mha", batch, 4, heads, None, dtype, engine_device)

    @pytest.mark.parametrize("window", ["w1", "block+1"])
    def test_sliding_window(self, window, dtype, engine_device):
        self.check_random_case("sliding_window", "mixed", 4, "gqa2", window, dtype, engine_device)

    @pytest.mark.parametrize("block_size", [4])
    def test_kv_cache_write(self, block_size, dtype, engine_device):
        super().test_kv_cache_write(block_size, dtype, engine_device)


class TestTritonMlaKit(AttentionBackendTests):
    """triton_mla: latent attention (values the entries' first latent_size dims) in decode,
    prefill and mixed batches, then a decode reading the new entries back."""

    plugin = "cpu"
    backend_name = "triton_mla"
    dtypes = ("float32",)

    def backend_class(self):
        return on_the_cpu(TritonMlaAttention)

    @pytest.mark.parametrize("batch", BATCHES)
    def test_mla(self, batch, dtype, engine_device):
        self.check_mla_case(batch, 4, list(MLA_SIZES)[0], dtype, engine_device, kind=MLA)

    @pytest.mark.parametrize("block_size", [4])
    def test_kv_cache_write(self, block_size, dtype, engine_device):
        super().test_kv_cache_write(block_size, dtype, engine_device)
