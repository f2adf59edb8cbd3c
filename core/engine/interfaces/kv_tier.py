"""The KVTier interface: secondary storage for prefix KV blocks.

The engine offers a tier every prefix block its primary cache evicts and, when a
request arrives, asks it for the blocks that follow the request's primary prefix
hit. Blocks cross this boundary in the *canonical layout*: one contiguous 1-D CPU
tensor per block, in the model's dtype, holding layer after layer the block's K
then V as ``[block_size, num_kv_heads, head_size]`` each (whatever the attention
backend's own cache layout or the tensor-parallel degree). Keys are the prefix
cache's chained block hashes (16 bytes): a key names a block's content and its
whole prefix, so equal keys are interchangeable blocks.

Models with recurrent layers (linear attention, Mamba-2) keep no per-token cache in
those layers, only a state per request, and a prefix hit also needs that state as it
was at the prefix's end: prefix caching keeps snapshots of it at block boundaries. A
snapshot goes to a tier as blocks of its own (``spec.state_blocks`` of them, the
canonical state's bytes cut into block-sized parts, zero-padded), under keys derived
from the hash of the block it ends with (:meth:`KVTierSpec.state_keys`), so that every
entry of a tier is one block of ``spec.block_bytes`` whatever the model.
"""

from __future__ import annotations

import hashlib
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
    ``layer_shapes`` lists, for each layer with a per-token cache, its ``(block_size,
    num_kv_heads, head_size)``: its keys, then its values, except for the layers listed in
    ``keys_only`` (by index in ``layer_shapes``), which cache one tensor a token: MLA's
    latent entries, a sparse-attention indexer's keys.

    ``state_numels`` lists, for each recurrent layer (linear attention, Mamba-2) in layer
    order, the float32 elements of its state with all its heads: the last ``conv_kernel - 1`` convolution
    inputs ``[conv_kernel - 1, conv_channels]``, then the recurrent matrix ``[num_heads,
    head_size, value_size or state_size]`` (:meth:`AttentionSpec.state_numel
    <engine.interfaces.attention.spec.AttentionSpec.state_numel>`). A snapshot of those
    states, layer after layer, is ``state_bytes`` bytes and travels as ``state_blocks``
    ordinary blocks (:meth:`state_keys`, :meth:`state_rows`, :meth:`state_of`): a tier
    stores, evicts and counts them as it does any block.
    """

    digest: str
    dtype: str
    block_size: int
    layer_shapes: tuple[tuple[int, int, int], ...]
    keys_only: tuple[int, ...] = ()
    state_numels: tuple[int, ...] = ()

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

    # recurrent-state snapshots

    @property
    def state_bytes(self) -> int:
        """Bytes of one snapshot of every recurrent layer's state (float32); 0 without such layers."""
        return 4 * sum(self.state_numels)

    @property
    def state_blocks(self) -> int:
        """How many blocks carry one snapshot: its bytes, cut into ``block_bytes`` parts."""
        return -(-self.state_bytes // self.block_bytes) if self.state_bytes else 0

    def state_keys(self, key: bytes) -> list[bytes]:
        """The keys of the ``state_blocks`` parts of the snapshot taken after the block ``key``
        (16 bytes each, apart from every block key: the digest of a tag, the key and the part)."""
        return [
            hashlib.blake2b(b"recurrent-state" + key + part.to_bytes(4, "little"), digest_size=16).digest()
            for part in range(self.state_blocks)
        ]

    def state_rows(self, state: torch.Tensor) -> torch.Tensor:
        """A snapshot's ``state_blocks`` blocks, ``[state_blocks, block_numel]`` in the spec's dtype:
        the bytes of ``state`` (``sum(state_numels)`` float32 elements, canonical layout), then zeros."""
        import torch

        if state.dtype != torch.float32 or state.numel() != sum(self.state_numels):
            raise ValueError(
                f"A recurrent-state snapshot is {sum(self.state_numels)} float32 elements, "
                f"got {state.numel()} of {state.dtype}."
            )
        raw = torch.zeros(self.state_blocks * self.block_bytes, dtype=torch.uint8)
        raw[: self.state_bytes] = state.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        return raw.view(getattr(torch, self.dtype)).view(self.state_blocks, self.block_numel)

    def state_of(self, rows: torch.Tensor) -> torch.Tensor:
        """The float32 snapshot (``sum(state_numels)`` elements) in blocks :meth:`state_rows` made."""
        import torch

        raw = rows.contiguous().reshape(-1).view(torch.uint8)[: self.state_bytes]
        return raw.clone().view(torch.float32)


@dataclass
class KVTierStats:
    """Counters since the tier opened (blocks, bytes, seconds), and a tier's own figures.

    The counters count blocks one at a time (and their bytes and seconds), and only grow
    while the tier is open (a persistent tier starts again from zero when it reopens):

    - ``hits``: blocks found by :meth:`KVTier.lookup`: each lookup adds the count it returns.
    - ``misses``: lookups that stopped short of their keys: each adds 1 (its first missing
      block; a lookup looks no further), a lookup that found every key adds 0. Loads count
      in neither ``hits`` nor ``misses``.
    - ``stored_blocks``: blocks a store returned ``True`` for, a key the tier held already
      included; ``store_failures``: blocks a store returned ``False`` for (a block of another
      dtype or size, a full disk, ...). Once a store's future is done, its blocks are in one
      of the two: their sum is every block offered.
    - ``loaded_blocks``: blocks a load returned ``True`` for; ``load_failures``: blocks a load
      returned ``False`` for (never stored, evicted since lookup, corrupt, ...). Once a load's
      future is done, their sum is every block asked for.
    - ``evicted_blocks``: blocks the tier dropped to stay within its capacity (not the ones
      lost to faults, which are a tier's own ``extra_counters``).
    - ``bytes_written``: ``spec.block_bytes`` per block the tier wrote (a key it held already
      and kept writes none); ``bytes_read``: ``spec.block_bytes`` per block loaded. Canonical
      block bytes, whatever the tier's own encoding or overhead.
    - ``store_seconds``, ``load_seconds``: the time stores and loads took, summed, whether in
      the calling thread or in the tier's own.

    ``extra_counters`` are what a tier counts beyond the fields here (named in snake_case, e.g.
    ``corrupt_blocks``): each only grows while the tier is open, and the server shows each on
    /metrics as the counter ``engine_kv_tier_<name>_total`` labelled with the tier's name.
    ``extra`` holds the tier's other figures, such as what it holds now and its capacity.
    """

    hits: int = 0  # blocks found by lookup
    misses: int = 0  # lookups that stopped short (one each: lookup stops at the first missing block)
    stored_blocks: int = 0  # blocks stores returned True for (keys already held included)
    loaded_blocks: int = 0  # blocks loads returned True for
    evicted_blocks: int = 0  # blocks dropped to stay within capacity
    bytes_written: int = 0  # block_bytes per block written (none for a key already held)
    bytes_read: int = 0  # block_bytes per block loaded
    store_failures: int = 0  # blocks stores returned False for (wrong dtype or size, disk full, read-only, ...)
    load_failures: int = 0  # blocks loads returned False for (never stored, evicted since lookup, corrupt, ...)
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
    engine at start-up. A tier with a capacity takes it as ``capacity_gb``, in GiB
    (2**30 bytes), as the built-in tiers do.

    Threads: the engine calls :meth:`lookup`, :meth:`store`, :meth:`load` and
    :meth:`close` from its one engine thread, one call at a time, while the futures
    of earlier stores may still be running; :meth:`stats` from any thread at any time
    (the server reads it when /metrics is scraped), after :meth:`close` too. A tier is
    nonetheless safe for calls of every method from several threads at once (the kit
    stores from four threads together).

    Futures: :meth:`store` and :meth:`load` return futures of one flag per block, in
    order; only ``True`` is success. A future may be complete on return (the ``cpu``
    tier's always are). The engine waits on a load's future at once, and loads the
    leading run of ``True`` blocks (a partial load is normal: it recomputes from the
    first failed block); a load that raises, in the call or in its future, costs a
    recompute of all its blocks and a warning in the log. The engine never waits on a
    store's future, so its outcome is seen only in :meth:`stats`: a store reports the
    blocks it could not keep as ``False`` rather than raising. A lookup or store that
    raises anyway (in the call, or a store's future) is logged as a warning and costs
    the offer or a recompute, never a request.

    Capabilities (class attributes):

    - ``persistent``: blocks survive :meth:`close` and reopening with the same
      spec digest (and never appear under another digest).
    - ``eviction``: which blocks go first when a store needs room. ``"lru"``: the
      least recently used, where a block is used when it is stored (a key the tier
      holds already included), found by a lookup (each of the leading blocks it
      counts) or returned by a load; blocks stored by one call may be used and
      evicted together (the ``disk`` tier keeps them in one segment). ``"fifo"``: the
      first stored, whatever their use. Any other string names a tier's own policy
      (``"lfu"``, ``"random"``, ...). The kit checks ``"lru"`` and ``"fifo"``
      exactly and every policy against the capacity.
    """

    name: ClassVar[str]
    persistent: ClassVar[bool] = False
    eviction: ClassVar[str] = "lru"

    def __init__(self, spec: KVTierSpec, config: Mapping[str, Any]) -> None:
        self.spec = spec
        self.config = dict(config)

    @abstractmethod
    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are present (a hint: a later load may still miss).
        Counts ``hits`` and ``misses`` (see :class:`KVTierStats`)."""

    @abstractmethod
    def store(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor]) -> Future[list[bool]]:
        """Keep copies of ``blocks`` (canonical layout) under ``keys``, evicting to stay within
        capacity. The tier must not hold on to the given tensors: the engine may reuse them once
        this call returns. A block of another dtype or number of elements than the spec's is
        refused (``False``)."""

    @abstractmethod
    def load(self, keys: Sequence[bytes], into: Sequence[torch.Tensor]) -> Future[list[bool]]:
        """Copy the blocks for ``keys`` into the given tensors (canonical layout, mutated in
        place); ``False`` for a block leaves its tensor's contents unspecified."""

    @abstractmethod
    def stats(self) -> KVTierStats:
        """The counters so far (a copy). May be called from any thread, and after :meth:`close`."""

    @abstractmethod
    def close(self) -> None:
        """Finish pending stores and release resources. Later calls of :meth:`lookup`,
        :meth:`store` and :meth:`load` raise ``RuntimeError``; a second ``close`` does nothing."""


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
