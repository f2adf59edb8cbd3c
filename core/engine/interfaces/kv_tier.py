"""The KVTier interface: secondary storage for prefix KV blocks.

The engine offers a tier every prefix block its primary cache evicts and, when a
request arrives, asks it for the blocks that follow the request's primary prefix
hit. Blocks cross this boundary in the *canonical layout*: one contiguous 1-D CPU
tensor per block, in the model's dtype, holding layer after layer the block's K
then V as ``[block_size, num_kv_heads, head_size]`` each (whatever the attention
backend's own cache layout or the tensor-parallel degree). Keys are the prefix
cache's chained block hashes (16 bytes): a key names a block's content and its
whole prefix, so equal keys are interchangeable blocks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Mapping, Sequence

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class KVTierSpec:
    """What a tier is told about the blocks it will hold.

    ``digest`` (hex) covers the model, dtype, block size and layer layout: blocks
    stored under one digest must never be served under another (a persistent tier
    keeps them apart, e.g. one directory per digest). ``block_numel`` elements of
    ``dtype`` (a torch dtype name such as ``"bfloat16"``) make one block;
    ``layer_shapes`` lists each layer's ``(block_size, num_kv_heads, head_size)``: its keys,
    then its values, except for the layers listed in ``keys_only`` (by index), which cache
    one tensor a token: MLA's latent entries, a sparse-attention indexer's keys.
    """

    digest: str
    dtype: str
    block_size: int
    layer_shapes: tuple[tuple[int, int, int], ...]
    keys_only: tuple[int, ...] = ()

    def tensors(self, layer: int) -> int:
        """How many tensors layer ``layer`` caches per token: 1 (keys only) or 2 (keys, values)."""
        return 1 if layer in self.keys_only else 2

    @property
    def block_numel(self) -> int:
        return sum(self.tensors(i) * bs * heads * size for i, (bs, heads, size) in enumerate(self.layer_shapes))

    @property
    def element_size(self) -> int:
        import torch

        return torch.empty(0, dtype=getattr(torch, self.dtype)).element_size()

    @property
    def block_bytes(self) -> int:
        return self.block_numel * self.element_size


@dataclass
class KVTierStats:
    """Counters since the tier opened (blocks, bytes, seconds), and a tier's own figures.

    ``extra_counters`` are what a tier counts beyond the fields here (named in snake_case, e.g.
    ``corrupt_blocks``): each only grows while the tier is open, and the server shows each on
    /metrics as the counter ``engine_kv_tier_<name>_total`` labelled with the tier's name.
    ``extra`` holds the tier's other figures, such as what it holds now and its capacity.
    """

    hits: int = 0  # blocks found by lookup
    misses: int = 0  # blocks looked up and not found (lookup stops at the first)
    stored_blocks: int = 0
    loaded_blocks: int = 0
    evicted_blocks: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    store_failures: int = 0  # blocks a store could not keep (disk full, read-only, ...)
    load_failures: int = 0  # blocks a load could not return (evicted since lookup, corrupt, ...)
    store_seconds: float = 0.0  # summed time of completed stores
    load_seconds: float = 0.0  # summed time of completed loads
    extra: dict[str, float] = field(default_factory=dict)  # tier-specific figures (may go up and down)
    extra_counters: dict[str, float] = field(default_factory=dict)  # tier-specific counters (only grow)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class KVTier(ABC):
    """Stores KV blocks keyed by prefix-block hashes.

    Constructed as ``cls(spec, config)``: ``config`` is the user's
    ``--kv-tier-config`` (a JSON object) and a tier raises ``ValueError`` naming
    the key at fault for anything it cannot use, so a bad configuration stops the
    engine at start-up. ``store`` and ``load`` return futures of per-block success
    flags; a partial load is normal and the engine recomputes the rest. Methods may
    be called from the engine's thread while earlier futures are still running.

    - ``persistent``: blocks survive :meth:`close` and reopening with the same
      spec digest (and never appear under another digest).
    """

    name: ClassVar[str]
    persistent: ClassVar[bool] = False

    def __init__(self, spec: KVTierSpec, config: Mapping[str, Any]) -> None:
        self.spec = spec
        self.config = dict(config)

    @abstractmethod
    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are present (a hint: a later load may still miss)."""

    @abstractmethod
    def store(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor]) -> Future[list[bool]]:
        """Keep copies of ``blocks`` (canonical layout) under ``keys``, evicting to stay within
        capacity. The tier must not hold on to the given tensors: the engine may reuse them once
        this call returns."""

    @abstractmethod
    def load(self, keys: Sequence[bytes], into: Sequence[torch.Tensor]) -> Future[list[bool]]:
        """Copy the blocks for ``keys`` into the given tensors (canonical layout, mutated in
        place); ``False`` for a block leaves its tensor's contents unspecified."""

    @abstractmethod
    def stats(self) -> KVTierStats:
        """The counters so far. May be called from any thread (the server reads them when
        /metrics is scraped)."""

    @abstractmethod
    def close(self) -> None:
        """Finish pending stores and release resources; later calls raise ``RuntimeError``."""


def config_number(config: Mapping[str, Any], key: str, default: float, *, tier: str, minimum: float = 0.0) -> float:
    """``config[key]`` as a number above ``minimum`` (or ``default``), else a ``ValueError`` naming it."""
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= minimum:
        raise ValueError(f"KV tier {tier!r}: {key!r} must be a number above {minimum:g}, got {value!r}.")
    return float(value)


def check_config_keys(config: Mapping[str, Any], known: Sequence[str], *, tier: str) -> None:
    unknown = sorted(set(config) - set(known))
    if unknown:
        raise ValueError(
            f"KV tier {tier!r}: unknown config key(s) {', '.join(map(repr, unknown))}; it takes "
            f"{', '.join(map(repr, known)) or 'none'}."
        )
