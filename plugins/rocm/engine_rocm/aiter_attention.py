"""``aiter_mha``: MHA / GQA / MQA and sliding-window attention through AMD's AITER kernels:
``aiter.flash_attn_varlen_func``, AITER's composable-kernel flash attention, over each step's
keys and values gathered from the engine's conventional cache layout
(:mod:`engine.kernels.varlen_attention`, which flash-attn's backend on CUDA shares).

``aiter`` is imported when the backend is built, not when the plugin loads; engine-rocm
prefers this backend only where ``aiter`` imports (see ``RocmPlatform``).
"""

from __future__ import annotations

from types import ModuleType

from engine.interfaces.attention import MHA, SLIDING_WINDOW, AttentionCapabilities
from engine.kernels.varlen_attention import VarlenFlashAttention


def import_aiter() -> ModuleType:
    """``aiter``, or a ``RuntimeError`` that says how to get it."""
    try:
        import aiter
    except ImportError as exc:
        raise RuntimeError(
            f"attention backend 'aiter_mha' needs AMD's aiter package, which cannot be imported ({exc}); "
            "install aiter (https://github.com/ROCm/aiter) or choose --attention-backend triton_paged"
        ) from exc
    if not hasattr(aiter, "flash_attn_varlen_func"):
        raise RuntimeError(
            "attention backend 'aiter_mha' needs aiter.flash_attn_varlen_func, which this aiter "
            f"({getattr(aiter, '__version__', 'unknown version')}) lacks; upgrade aiter"
        )
    return aiter


class AiterPagedAttention(VarlenFlashAttention):
    """MHA / GQA / MQA and sliding-window attention by ``aiter.flash_attn_varlen_func``
    (half precision, as AITER's kernels are built)."""

    name = "aiter_mha"
    capabilities = AttentionCapabilities(
        kinds=frozenset({MHA, SLIDING_WINDOW}),
        platforms=frozenset({"rocm"}),
        dtypes=frozenset({"bfloat16", "float16"}),
        graph_capturable=False,
    )

    def load_kernel(self):
        return import_aiter().flash_attn_varlen_func
