"""The KVTier interface: secondary storage for prefix KV blocks."""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, ClassVar, Sequence

if TYPE_CHECKING:
    import torch


class KVTier(ABC):
    """Stores KV blocks keyed by prefix-block hashes (bytes).

    Blocks cross this boundary in the canonical layout: one tensor per block
    holding every layer's K and V for the block's tokens, independent of
    tensor-parallel degree. ``store`` and ``load`` return futures of per-block
    success flags; a partial load is normal and the engine recomputes the rest.

    - ``persistent``: blocks survive :meth:`close` and reopening with the same
      configuration.
    """

    name: ClassVar[str]
    persistent: ClassVar[bool] = False

    @abstractmethod
    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are present."""

    @abstractmethod
    def store(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor]) -> Future[list[bool]]:
        """Copy ``blocks`` in under ``keys``; may evict to stay within capacity."""

    @abstractmethod
    def load(self, keys: Sequence[bytes], into: Sequence[torch.Tensor]) -> Future[list[bool]]:
        """Copy the blocks for ``keys`` into the given tensors (mutated in place)."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters: hits, misses, bytes read/written, failures, latency."""

    @abstractmethod
    def close(self) -> None:
        """Release resources; later calls raise ``RuntimeError``."""
