"""engine-cuda's FlashInfer and flash-attn backends, with the libraries replaced by plain torch
implementations of their documented interfaces (``engine.testing.oracles``), through the
attention kit; and the platform's preferences: those backends first where the libraries
import and are recent enough, the Triton backends otherwise. What runs for real is the
backends: cache writes, FlashInfer's CSR page table and plan, flash-attn's gather through
the block tables, and the arguments each hands its library."""

from __future__ import annotations

import dataclasses
import logging
import sys
import types

import pytest
import torch

from engine.interfaces.attention import INDEXER, LINEAR, MHA, MLA, SLIDING_WINDOW, SPARSE_MLA, AttentionSpec
from engine.interfaces.attention.metadata import CommonAttentionMetadata
from engine.plugins.manager import get_plugin_manager
from engine.testing.kit import AttentionBackendTests
from engine.testing.oracles import FlashInferPrefillWrapper, flash_attn_varlen_func
from engine_cuda.flash_attention import FlashAttnPagedAttention
from engine_cuda.flashinfer_attention import FlashInferPagedAttention, page_table
from engine_cuda.platform import CudaPlatform


def fake_flashinfer(version: str = "0.2.8") -> types.ModuleType:
    module = types.ModuleType("flashinfer")
    module.__version__ = version
    module.BatchPrefillWithPagedKVCacheWrapper = FlashInferPrefillWrapper
    return module


def fake_flash_attn(version: str = "2.7.4.post1") -> types.ModuleType:
    module = types.ModuleType("flash_attn")
    module.__version__ = version
    module.flash_attn_varlen_func = flash_attn_varlen_func
    return module


@pytest.fixture
def libraries(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer())
    monkeypatch.setitem(sys.modules, "flash_attn", fake_flash_attn())


def on_the_cpu(cls):
    return type(
        f"Cpu{cls.__name__}",
        (cls,),
        {
            "capabilities": dataclasses.replace(
                cls.capabilities,
                platforms=frozenset({"cpu"}),
                dtypes=frozenset({"float32", "bfloat16"}),
                head_sizes=None,
            ),
        },
    )


@pytest.mark.usefixtures("libraries")
class TestFlashInferKit(AttentionBackendTests):
    """flashinfer against the kit's naive oracle: MHA/GQA/MQA in decode, prefill after a cached
    prefix and mixed batches, sliding windows across block edges, cache writes."""

    plugin = "cuda"
    backend_name = "flashinfer"
    dtypes = ("float32", "bfloat16")

    def backend_class(self):
        return on_the_cpu(FlashInferPagedAttention)


@pytest.mark.usefixtures("libraries")
class TestFlashAttnKit(AttentionBackendTests):
    plugin = "cuda"
    backend_name = "flash_attn"
    dtypes = ("float32", "bfloat16")

    def backend_class(self):
        return on_the_cpu(FlashAttnPagedAttention)


def spec(window: int | None = None) -> AttentionSpec:
    return AttentionSpec(
        kind=SLIDING_WINDOW if window else MHA,
        num_heads=4,
        num_kv_heads=2,
        head_size=64,
        scale=0.125,
        sliding_window=window,
    )


def test_the_page_table_is_flashinfers_csr_form_of_the_block_tables():
    """Sequences of 1, 16, 17 and 40 tokens in blocks of 16: 1, 1, 2 and 3 pages, the last
    holding 1, 16, 1 and 8 tokens; padding entries of the block table are left out."""
    seq_lens = torch.tensor([1, 16, 17, 40])
    query_lens = torch.tensor([1, 16, 1, 5])
    tables = torch.tensor([[7, 0, 0], [3, 0, 0], [9, 4, 0], [1, 2, 8]])
    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, 1, 17, 18, 23]),
        query_lens=query_lens,
        context_lens=seq_lens - query_lens,
        seq_lens=seq_lens,
        block_tables=tables,
        slot_mapping=torch.zeros(23, dtype=torch.long),
        max_query_len=16,
        max_seq_len=40,
        block_size=16,
    )
    table = page_table(common)
    assert table.kv_indptr.tolist() == [0, 1, 2, 4, 7] and table.kv_indices.tolist() == [7, 3, 9, 4, 1, 2, 8]
    assert table.last_page_len.tolist() == [1, 16, 1, 8] and table.qo_indptr.tolist() == [0, 1, 17, 18, 23]
    assert {t.dtype for t in (table.kv_indptr, table.kv_indices, table.last_page_len, table.qo_indptr)} == {torch.int32}


@pytest.mark.usefixtures("libraries")
def test_flashinfer_plans_with_the_specs_heads_scale_and_window():
    backend = FlashInferPagedAttention(spec(window=24), 16, torch.bfloat16, torch.device("cpu"))
    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, 3]),
        query_lens=torch.tensor([3]),
        context_lens=torch.tensor([30]),
        seq_lens=torch.tensor([33]),
        block_tables=torch.tensor([[5, 6, 2]]),
        slot_mapping=torch.tensor([6 * 16 + 14, 6 * 16 + 15, 2 * 16]),  # positions 30, 31, 32
        max_query_len=3,
        max_seq_len=33,
        block_size=16,
    )
    backend.build_metadata(common)
    planned = backend.wrapper.planned
    assert planned["heads"] == (4, 2, 64) and planned["page_size"] == 16 and planned["causal"]
    assert planned["scale"] == 0.125 and planned["window_left"] == 23 and planned["dtype"] == torch.bfloat16
    assert backend.workspace.dtype == torch.uint8 and backend.workspace.device.type == "cpu"


def preferences() -> dict[str, tuple[str, ...]]:
    platform = CudaPlatform()
    return {
        kind: platform.attention_backend_preferences(kind)
        for kind in (MHA, SLIDING_WINDOW, MLA, LINEAR, SPARSE_MLA, INDEXER)
    }


TRITON = {
    MHA: ("triton_paged",),
    SLIDING_WINDOW: ("triton_paged",),
    MLA: ("triton_mla",),
    LINEAR: ("triton_kda",),
    SPARSE_MLA: (),
    INDEXER: (),
}


def with_first(*names: str) -> dict[str, tuple[str, ...]]:
    return {**TRITON, MHA: (*names, "triton_paged"), SLIDING_WINDOW: (*names, "triton_paged")}


def test_preferences_follow_what_imports(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import raises ModuleNotFoundError: quietly passed over
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    with caplog.at_level(logging.WARNING, logger="engine.cuda"):
        assert preferences() == TRITON
    assert not caplog.records
    monkeypatch.setitem(sys.modules, "flash_attn", fake_flash_attn())
    assert preferences() == with_first("flash_attn")
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer())
    assert preferences() == with_first("flashinfer", "flash_attn")
    monkeypatch.setenv("ENGINE_CUDA_FLASHINFER", "0")
    assert preferences() == with_first("flash_attn")
    monkeypatch.setenv("ENGINE_CUDA_FLASH_ATTN", "off")
    assert preferences() == TRITON


def test_too_old_libraries_are_passed_over_with_a_warning_and_refused_with_the_fix(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer("0.1.6"))
    monkeypatch.setitem(sys.modules, "flash_attn", fake_flash_attn("2.2.5"))
    with caplog.at_level(logging.WARNING, logger="engine.cuda"):
        assert preferences() == TRITON
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "flashinfer 0.1.6 is older than 0.2" in messages and "flash_attn 2.2.5 is older than 2.3" in messages
    with pytest.raises(RuntimeError, match="upgrade flashinfer-python"):
        FlashInferPagedAttention(spec(), 16, torch.bfloat16, torch.device("cpu"))
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    with pytest.raises(RuntimeError, match="pip install flash-attn.*--attention-backend triton_paged"):
        FlashAttnPagedAttention(spec(), 16, torch.bfloat16, torch.device("cpu"))


def test_registered_for_cuda_whether_or_not_the_libraries_are_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    registry = get_plugin_manager(["cuda"]).components().attention_backends
    for name in ("flashinfer", "flash_attn"):
        capabilities = registry.get(name).capabilities
        assert capabilities.platforms == {"cuda"} and MHA in capabilities.kinds and not capabilities.graph_capturable
