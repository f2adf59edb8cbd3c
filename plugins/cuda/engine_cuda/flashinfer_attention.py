"""``flashinfer``: MHA / GQA / MQA and sliding-window attention by FlashInfer's
``BatchPrefillWithPagedKVCacheWrapper`` (0.2 or newer), reading the engine's paged cache
where it lies.

The cache is ``[2, blocks, block_size, Hkv, D]`` (the same as ``triton_paged``): keys and
values are FlashInfer's ``NHD`` page pools, one page per engine block. Each step the
backend describes every sequence's pages in FlashInfer's CSR form, ``paged_kv_indptr``
(pages per sequence, summed), ``paged_kv_indices`` (the block ids, sequence after sequence)
and ``paged_kv_last_page_len`` (the tokens in each sequence's last page), with
``qo_indptr`` (its new tokens) and plans the batch once; every layer of the group then
writes its new keys and values into the cache and runs the plan. FlashInfer's causal mask
aligns a sequence's queries to the end of its keys, so a prefill chunk after a cached
prefix and a decode step are the same call; a sliding window of ``W`` keys is
``window_left = W - 1``.

Planning reads the page counts on the host, so the backend cannot be captured in a device
graph (decode steps then run eagerly)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.interfaces.attention import (
    MHA,
    SLIDING_WINDOW,
    AttentionCapabilities,
    CommonAttentionMetadata,
    PagedAttentionBackend,
)
from engine_cuda.attention_libraries import FLASHINFER, load

WORKSPACE_BYTES = 128 * 2**20  # FlashInfer's scratch for split-KV partial results


@dataclass
class FlashInferMetadata:
    common: CommonAttentionMetadata
    qo_indptr: torch.Tensor  # [B + 1] int32
    kv_indptr: torch.Tensor  # [B + 1] int32
    kv_indices: torch.Tensor  # [sum(pages)] int32
    last_page_len: torch.Tensor  # [B] int32


def page_table(common: CommonAttentionMetadata) -> FlashInferMetadata:
    """FlashInfer's CSR page table of the step: each sequence's first ⌈seq_len / block_size⌉
    blocks, and how full the last one is."""
    block_size = common.block_size
    pages = (common.seq_lens + block_size - 1) // block_size
    kv_indptr = torch.zeros(common.num_seqs + 1, dtype=torch.int32, device=pages.device)
    kv_indptr[1:] = torch.cumsum(pages, 0)
    columns = torch.arange(common.block_tables.shape[1], device=pages.device)
    kv_indices = common.block_tables[columns[None, :] < pages[:, None]].to(torch.int32)
    last_page_len = (common.seq_lens - (pages - 1) * block_size).to(torch.int32)
    return FlashInferMetadata(common, common.query_start_loc.to(torch.int32), kv_indptr, kv_indices, last_page_len)


class FlashInferPagedAttention(PagedAttentionBackend):
    """FlashInfer's batch prefill / append attention over paged keys and values (half
    precision; head sizes 64, 128 and 256)."""

    name = "flashinfer"
    capabilities = AttentionCapabilities(
        kinds=frozenset({MHA, SLIDING_WINDOW}),
        platforms=frozenset({"cuda"}),
        dtypes=frozenset({"bfloat16", "float16"}),
        head_sizes=frozenset({64, 128, 256}),
        graph_capturable=False,
    )

    def __init__(self, spec, block_size: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(spec, block_size, dtype, device)
        flashinfer = load(FLASHINFER)
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (2, num_blocks, self.block_size, self.spec.num_kv_heads, self.spec.head_size)

    def build_metadata(self, common: CommonAttentionMetadata) -> FlashInferMetadata:
        spec = self.spec
        table = page_table(common)
        self.wrapper.plan(
            table.qo_indptr,
            table.kv_indptr,
            table.kv_indices,
            table.last_page_len,
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_size,
            self.block_size,
            causal=True,
            sm_scale=spec.scale,
            window_left=spec.sliding_window - 1 if spec.sliding_window else -1,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
        )
        return table

    def forward(self, q, k, v, kv_cache: torch.Tensor, metadata: FlashInferMetadata) -> torch.Tensor:
        spec, common = self.spec, metadata.common
        keys, values = kv_cache[0], kv_cache[1]  # [blocks, block_size, Hkv, D]: NHD pages
        keys.view(-1, spec.num_kv_heads, spec.head_size).index_copy_(0, common.slot_mapping, k)
        values.view(-1, spec.num_kv_heads, spec.head_size).index_copy_(0, common.slot_mapping, v)
        return self.wrapper.run(q, (keys, values)).to(q.dtype)
