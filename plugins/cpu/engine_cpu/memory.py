"""Host memory on transparent huge pages, for the large buffers the kernels stream.

Decode reads the whole KV cache of every running sequence and every weight once
per step. On 4 KiB pages that walk misses the TLB every few kilobytes; on 2 MiB
pages (transparent huge pages, granted by ``madvise(MADV_HUGEPAGE)`` where the
kernel runs THP in "madvise" mode, as most distributions do) the same reads run
about a quarter faster here. Where madvise is missing or refused the buffer is
plain memory: only speed differs. ``ENGINE_CPU_HUGE_PAGES=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import os

import torch

logger = logging.getLogger("engine.cpu")

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # linux/mman.h


@functools.lru_cache(maxsize=1)
def _madvise():
    if os.environ.get("ENGINE_CPU_HUGE_PAGES", "1") in ("0", "false", "False") or os.uname().sysname != "Linux":
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled contiguous CPU tensor whose memory was advised onto huge pages
    before it was first touched (small tensors, under one huge page, are plain)."""
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    madvise = _madvise()
    if madvise is None or nbytes < HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)  # room to start on a 2 MiB boundary
    start = -raw.data_ptr() % HUGE_PAGE
    length = nbytes // HUGE_PAGE * HUGE_PAGE
    if madvise(raw.data_ptr() + start, length, MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) refused: errno %d", ctypes.get_errno())
    tensor = raw[start : start + nbytes].view(dtype).view(shape)
    tensor.zero_()  # first touch: the kernel backs it with huge pages now
    return tensor
