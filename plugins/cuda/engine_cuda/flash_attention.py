"""``flash_attn``: MHA / GQA / MQA and sliding-window attention by flash-attn's
``flash_attn_varlen_func`` (2.3 or newer) over each step's keys and values gathered from the
engine's conventional cache (:mod:`engine.kernels.varlen_attention`). flash-attn is imported
when the backend is built; engine-cuda prefers it only where it imports
(``engine_cuda.attention_libraries``)."""

from __future__ import annotations

from engine.interfaces.attention import MHA, SLIDING_WINDOW, AttentionCapabilities
from engine.kernels.varlen_attention import VarlenFlashAttention
from engine_cuda.attention_libraries import FLASH_ATTN, load


class FlashAttnPagedAttention(VarlenFlashAttention):
    """flash-attn 2's varlen forward (half precision; head sizes up to 256, multiples of 8)."""

    name = "flash_attn"
    capabilities = AttentionCapabilities(
        kinds=frozenset({MHA, SLIDING_WINDOW}),
        platforms=frozenset({"cuda"}),
        dtypes=frozenset({"bfloat16", "float16"}),
        head_sizes=frozenset(range(8, 257, 8)),
        graph_capturable=False,
    )

    def load_kernel(self):
        return load(FLASH_ATTN).flash_attn_varlen_func
