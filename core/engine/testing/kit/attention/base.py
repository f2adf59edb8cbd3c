"""What every attention check shares: the step metadata as the model runner builds it, random
ragged batches over shuffled blocks, and the backend under test with its declared capabilities."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from engine.interfaces.attention import AttentionBackend, CommonAttentionMetadata
from engine.testing.kit.base import KitTests, capability_skip

KIT_BLOCK_SIZES = (1, 4, 16)
KIT_HEAD_SIZES = (16, 32, 64)
# MLA entries: (latent_size, rope dims), head_size their sum
MLA_SIZES = {"32+8": (32, 8), "64+16": (64, 16)}
BATCHES = ("decode", "prefill", "mixed")


def make_common_metadata(
    context_lens: list[int],
    query_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
    state_slots: list[int] | None = None,
) -> CommonAttentionMetadata:
    """One step's metadata, computed as the engine's model runner does (runtime/model_runner.py).

    Sequence ``b`` has ``context_lens[b]`` cached tokens and ``query_lens[b]`` new ones, and
    owns the physical blocks ``block_tables[b]`` (rows padded with block 0) and, for linear
    attention, the state slot ``state_slots[b]``.
    """
    width = max(len(table) for table in block_tables)
    tables = torch.tensor([table + [0] * (width - len(table)) for table in block_tables], dtype=torch.int64)
    context = torch.tensor(context_lens, dtype=torch.int64)  # [B]
    query = torch.tensor(query_lens, dtype=torch.int64)  # [B]
    seq_lens = context + query
    query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int64)  # [B + 1]
    query_start_loc[1:] = query.cumsum(0)
    seq_idx = torch.repeat_interleave(torch.arange(len(query_lens)), query)  # [T]
    positions = torch.arange(int(query.sum())) - query_start_loc[seq_idx] + context[seq_idx]  # [T]
    slot_mapping = tables[seq_idx, positions // block_size] * block_size + positions % block_size  # [T]
    return CommonAttentionMetadata(
        query_start_loc=query_start_loc.to(device),
        query_lens=query.to(device),
        context_lens=context.to(device),
        seq_lens=seq_lens.to(device),
        block_tables=tables.to(device),
        slot_mapping=slot_mapping.to(device),
        max_query_len=int(query.max()),
        max_seq_len=int(seq_lens.max()),
        block_size=block_size,
        state_slots=None if state_slots is None else torch.tensor(state_slots, dtype=torch.int64, device=device),
    )


def random_batch(batch: str, gen: torch.Generator) -> tuple[list[int], list[int]]:
    """(context_lens, query_lens) of a random ragged batch of kind ``batch``."""

    def randint(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (1,), generator=gen))

    if batch == "decode":  # ragged cached contexts, one new token each
        n = randint(3, 6)
        return [randint(0, 40) for _ in range(n)], [1] * n
    if batch == "prefill":  # chunks of 2..24 tokens, most after a cached prefix
        n = randint(1, 3)
        return [randint(0, 24) for _ in range(n)], [randint(2, 24) for _ in range(n)]
    # mixed: decodes and chunks interleaved, at least one of each
    n = randint(3, 5)
    rows = [(randint(1, 40), 1), (randint(0, 20), randint(2, 20))]
    rows += [(randint(0, 30), 1 if randint(0, 1) else randint(2, 20)) for _ in range(n - 2)]
    order = torch.randperm(n, generator=gen).tolist()
    return [rows[i][0] for i in order], [rows[i][1] for i in order]


def shuffled_block_tables(
    seq_lens: list[int], block_size: int, gen: torch.Generator, spare: int = 3
) -> tuple[list[list[int]], int]:
    """Each sequence's blocks, drawn at random from a pool with ``spare`` unused blocks."""
    counts = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(counts) + spare
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, start = [], 0
    for count in counts:
        tables.append(perm[start : start + count])
        start += count
    return tables, num_blocks


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns of ``t``'s elements, as integers (for byte-exact comparisons)."""
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(ints[t.element_size()])


class AttentionKitBase(KitTests):
    """The backend under test and its declared capabilities; the per-kind checks build on it
    (engine.testing.kit.attention composes them into ``AttentionBackendTests``)."""

    registry_name = "attention_backends"
    backend_name: ClassVar[str | None] = None
    dtypes: ClassVar[tuple[str, ...]] = ("float32",)
    tolerances: ClassVar[dict[str, tuple[float, float]]] = {
        "float32": (1e-5, 1e-5),
        "bfloat16": (2e-2, 2e-2),
        "float16": (2e-3, 2e-3),
    }

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        """Checks taking a ``dtype`` argument run once per entry of this class's ``dtypes`` (and
        skip for one the backend does not declare); the declared dtypes add none."""
        if "dtype" in metafunc.fixturenames:
            metafunc.parametrize("dtype", list(metafunc.cls.dtypes))

    def backend_class(self) -> type[AttentionBackend]:
        """The registered backend class, resolved once per kit class (cached on the class)."""
        cls = type(self)
        if "_kit_backend_class" not in cls.__dict__:
            cls._kit_backend_class = self.resolve(self.required("backend_name"))
        return cls._kit_backend_class

    def torch_device(self, engine_device: str) -> torch.device:
        """The torch device of the platform ``engine_device`` (from any installed plugin)."""
        if engine_device == "cpu":
            return torch.device("cpu")
        from engine.plugins.manager import get_plugin_manager

        platforms = self.components().platforms
        if engine_device not in platforms:
            platforms = get_plugin_manager([], autoload=True).components().platforms
        platform = platforms.get(engine_device)
        availability = platform.is_available()
        if not availability:
            pytest.skip(f"platform {engine_device} is not available: {availability.reason}")
        return platform().device()

    def setup_backend(
        self, kind: str, dtype: str, engine_device: str, block_size: int
    ) -> tuple[type[AttentionBackend], torch.device]:
        """Skip unless the backend declares kind, dtype, platform and block size."""
        cls = self.backend_class()
        caps = cls.capabilities
        if kind not in caps.kinds:
            capability_skip(f"attention kind {kind}")
        if dtype not in caps.dtypes:
            capability_skip(f"dtype {dtype}")
        if engine_device not in caps.platforms:
            capability_skip(f"platform {engine_device}")
        if caps.block_sizes is not None and block_size not in caps.block_sizes:
            capability_skip(f"block size {block_size}")
        return cls, self.torch_device(engine_device)

    def head_size(self, index: int) -> int:
        """The ``index``-th (cyclically) head size to check: 16/32/64 where declared."""
        declared = self.backend_class().capabilities.head_sizes
        sizes = [h for h in KIT_HEAD_SIZES if declared is None or h in declared] or sorted(declared)[:3]
        return sizes[index % len(sizes)]

    def mla_sizes(self, index: int) -> tuple[int, int]:
        """The ``index``-th (cyclically) MLA ``(latent_size, rope dims)`` to check: 32+8 and 64+16
        where their sum is a declared head size, else declared head sizes split 8:1 (576: 512+64)."""
        declared = self.backend_class().capabilities.head_sizes
        sizes = [s for s in MLA_SIZES.values() if declared is None or sum(s) in declared]
        sizes = sizes or [(h - h // 9, h // 9) for h in sorted(declared)[:2]]
        return sizes[index % len(sizes)]
