"""This process's place in the tensor-parallel group, and the collectives layers use.

Tensor parallelism runs on ``torch.distributed``: gloo on the CPU, the platform's backend
(``Platform.dist_backend``: nccl, which is RCCL on ROCm, or xccl) elsewhere. Every rank
holds its shard of each layer; a model receives its rank's :class:`TensorParallel` as
``ModelInit.tp``, hands it to its layers (``tp=``) when it builds them, and they call its
collectives in ``forward``. With one rank (:data:`SINGLE`, the default) every collective
is the identity and no process group exists.

:func:`get_tp`, :func:`set_tp` and :func:`tensor_parallel` are deprecated: a process-wide
group kept for one minor version for plugins written against engine 0.1, whose layers were
built without ``tp=`` (a layer given ``tp=None`` still reads it). The engine no longer
relies on it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TensorParallel:
    """Rank ``rank`` of ``size``; ``group`` carries the layers' collectives (None: the
    default group), ``control_group`` the engine's step messages (a gloo group, so that
    they stay on the CPU whatever the device backend)."""

    rank: int = 0
    size: int = 1
    group: Any = None
    control_group: Any = None

    @property
    def is_parallel(self) -> bool:
        return self.size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks, in place."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``x`` (equal shapes), concatenated along ``dim`` in rank order."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def split(self, total: int, what: str) -> tuple[int, int]:
        """This rank's ``(start, length)`` of ``total`` items split evenly; a ``ValueError``
        naming ``what`` when they do not split evenly."""
        if total % self.size:
            raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size {self.size}.")
        length = total // self.size
        return self.rank * length, length

    def padded_split(self, total: int) -> tuple[int, int, int]:
        """``(start, length, padded_length)`` of this rank's part of ``total`` rows split into
        ``ceil(total / size)``-row parts (the last may be short: ``length < padded_length``)."""
        per = -(-total // self.size)
        start = min(self.rank * per, total)
        return start, min(per, total - start), per

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """This rank's ``(first KV head, count)``: an even split when there are at least as
        many KV heads as ranks, else one head, replicated on ``size / num_kv_heads`` ranks."""
        if num_kv_heads >= self.size:
            start, count = self.split(num_kv_heads, "num_key_value_heads")
            return start, count
        if self.size % num_kv_heads:
            raise ValueError(
                f"The tensor-parallel size {self.size} is neither a divisor nor a multiple of "
                f"num_key_value_heads ({num_kv_heads})."
            )
        return self.rank * num_kv_heads // self.size, 1


SINGLE = TensorParallel()

# deprecated: the process-wide group of engine 0.1, read only by layers given no ``tp``
_current: TensorParallel = SINGLE


def get_tp() -> TensorParallel:
    """Deprecated (kept for plugins written against engine 0.1): the process-wide group set by
    :func:`set_tp` or :func:`tensor_parallel`, size 1 unless set. The engine no longer relies
    on it; a model reads ``ModelInit.tp`` and passes it to its layers as ``tp=``."""
    return _current


def set_tp(tp: TensorParallel) -> None:
    """Deprecated (kept for plugins written against engine 0.1): make ``tp`` what
    :func:`get_tp` answers."""
    global _current
    _current = tp


@contextmanager
def tensor_parallel(tp: TensorParallel) -> Iterator[TensorParallel]:
    """Deprecated (kept for plugins written against engine 0.1): :func:`get_tp` answers ``tp``
    inside the block, so layers built there without ``tp=`` take their part. The engine no
    longer relies on it: it passes the group to models as ``ModelInit.tp``."""
    previous = get_tp()
    set_tp(tp)
    try:
        yield tp
    finally:
        set_tp(previous)


def resolve_tp(tp: TensorParallel | None) -> TensorParallel:
    """What a layer given ``tp`` shards over: ``tp``, or for ``None`` (a layer built by code
    written against engine 0.1, which passed no group) the deprecated :func:`get_tp`."""
    return get_tp() if tp is None else tp
