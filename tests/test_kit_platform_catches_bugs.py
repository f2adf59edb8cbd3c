"""PlatformTests fails a broken platform: each deliberately broken variant below fails
exactly the kit checks named for it in ``CAUGHT_BY`` and passes the others, and the CPU
platform passes them all."""

from __future__ import annotations

import sys
from pathlib import Path

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))
from plugin_helpers import run_kit_in_subprocess  # noqa: E402

pytest_plugins = ["pytester"]

PLUGIN = """
import dataclasses

import torch.nn.functional as F

import engine
from engine.interfaces.ops import LayerOps
from engine.interfaces.platform import Availability, MemoryInfo
from engine.layers.linear import UnquantizedLinearMethod
from engine_cpu.attention import CpuPagedAttention
from engine_cpu.platform import CpuPlatform

NAMES = (
    "good_cpu", "silent", "bad_dtype", "ghost_pref", "dirty_cache", "frozen_stats", "raising_probe", "foreign_pref",
    "wrong_kind_pref", "overfull_memory", "greedy_kv_default", "unseeded", "fixed_seed", "fp32_cache",
    "transposed_cache", "biasless_linear", "last_max_argmax", "order_blind_group_quant", "swapped_gate_up",
)


class Backend(CpuPagedAttention):
    name = "for_test_platforms"
    capabilities = dataclasses.replace(CpuPagedAttention.capabilities, platforms=frozenset(NAMES))


class CpuOnlyBackend(CpuPagedAttention):
    name = "for_test_cpu_only"
    capabilities = dataclasses.replace(CpuPagedAttention.capabilities, platforms=frozenset({"cpu"}))


class Good(CpuPlatform):
    name = "good_cpu"
    attention_backends = {"mha": ("for_test_platforms",), "sliding_window": ("for_test_platforms",)}


class SilentProbe(Good):
    name = "silent"

    @classmethod
    def is_available(cls):
        return Availability(True, "")


class ClaimsHalfButBreaksIt(Good):
    name = "bad_dtype"
    supported_dtypes = ("float32", "bfloat16", "complex64x")


class PrefersAGhost(Good):
    name = "ghost_pref"
    attention_backends = {"mha": ("no_such_backend",)}


class DirtyCache(Good):
    name = "dirty_cache"

    def allocate_kv_cache(self, shape, dtype):
        import torch
        return torch.ones(shape, dtype=dtype)


class FrozenStats(Good):
    # claims allocator counters that never move

    name = "frozen_stats"

    def memory_stats(self):
        return (1 << 20, 1 << 20)


class RaisingProbe(Good):
    # the driver probe's exception escapes instead of becoming Availability(False, reason)

    name = "raising_probe"

    @classmethod
    def is_available(cls):
        raise RuntimeError("libfoo.so: cannot open shared object file")


class PrefersAForeignBackend(Good):
    # a registered backend, but one that does not declare this platform

    name = "foreign_pref"
    attention_backends = {"mha": ("for_test_cpu_only",)}


class PrefersTheWrongKind(Good):
    # a backend that declares mha and sliding_window only, preferred for mla

    name = "wrong_kind_pref"
    attention_backends = {"mha": ("for_test_platforms",), "mla": ("for_test_platforms",)}


class OverfullMemory(Good):
    # counts swap as free memory

    name = "overfull_memory"

    def memory_info(self):
        info = super().memory_info()
        return MemoryInfo(free_bytes=info.total_bytes + (1 << 30), total_bytes=info.total_bytes)


class GreedyKvDefault(Good):
    # sizes the default KV cache by the total, not the free, memory

    name = "greedy_kv_default"

    def default_kv_cache_bytes(self):
        return self.memory_info().total_bytes * 2


class Unseeded(Good):
    # seeds Python's and NumPy's generators but not torch's

    name = "unseeded"

    def seed_everything(self, seed):
        import random

        import numpy as np

        random.seed(seed)
        np.random.seed(seed)


class FixedSeed(Good):
    # seeds every generator, always with 0

    name = "fixed_seed"

    def seed_everything(self, seed):
        super().seed_everything(0)


class Fp32Cache(Good):
    # allocates every cache in float32, whatever dtype is asked

    name = "fp32_cache"

    def allocate_kv_cache(self, shape, dtype):
        import torch
        return torch.zeros(shape, dtype=torch.float32)


class TransposedCache(Good):
    # the right shape, as a view of a tensor laid out the other way round

    name = "transposed_cache"

    def allocate_kv_cache(self, shape, dtype):
        import torch
        return torch.zeros(tuple(reversed(shape)), dtype=dtype).permute(*reversed(range(len(shape))))


class BiaslessMethod(UnquantizedLinearMethod):
    def apply(self, layer, x):
        return F.linear(x, layer.weight)  # forgets layer.bias


class BiaslessLinear(Good):
    # a faster linear method that drops the bias

    name = "biasless_linear"

    def linear_method(self, dtype):
        return BiaslessMethod()


class SwappedGateUpMethod(UnquantizedLinearMethod):
    def apply_silu_and_mul(self, layer, x):
        gate, up = F.linear(x, layer.weight).chunk(2, dim=-1)
        return F.silu(up) * gate  # the activation on the wrong half


class SwappedGateUp(Good):
    # a fused gate/up kernel that takes the halves the other way round

    name = "swapped_gate_up"

    def linear_method(self, dtype):
        return SwappedGateUpMethod()


class LastMaxOps(LayerOps):
    def argmax(self, logits):
        # the last of equal maxima, where torch.argmax gives the first
        flipped = logits.flip(-1).argmax(dim=-1)
        return logits.shape[-1] - 1 - flipped


class LastMaxArgmax(Good):
    # fused layer ops whose greedy argmax breaks ties the other way

    name = "last_max_argmax"

    def layer_ops(self, dtype):
        return LastMaxOps()


class OrderBlindOps(LayerOps):
    def group_quant_linear(self, x, weight, bias=None):
        # ignores the weight's input order (act-order GPTQ), as a kernel given x as it came would
        from engine.interfaces.group_quant import group_quant_linear

        unordered = dataclasses.replace(weight, input_order=None)
        return group_quant_linear(x, unordered, bias)


class OrderBlindGroupQuant(Good):
    # a group-quantized kernel that forgets to gather the inputs

    name = "order_blind_group_quant"

    def layer_ops(self, dtype):
        return OrderBlindOps()


@engine.hookimpl
def register_platforms(register):
    for cls in (
        Good, SilentProbe, ClaimsHalfButBreaksIt, PrefersAGhost, DirtyCache, FrozenStats, RaisingProbe,
        PrefersAForeignBackend, PrefersTheWrongKind, OverfullMemory, GreedyKvDefault, Unseeded, FixedSeed,
        Fp32Cache, TransposedCache, BiaslessLinear, LastMaxArgmax, OrderBlindGroupQuant, SwappedGateUp,
    ):
        register(cls)


@engine.hookimpl
def register_attention_backends(register):
    register(Backend)
    register(CpuOnlyBackend)
"""

VARIANTS = {
    "TestGood": "good_cpu",
    "TestSilent": "silent",
    "TestBadDtype": "bad_dtype",
    "TestGhostPref": "ghost_pref",
    "TestDirtyCache": "dirty_cache",
    "TestFrozenStats": "frozen_stats",
    "TestRaisingProbe": "raising_probe",
    "TestForeignPref": "foreign_pref",
    "TestWrongKindPref": "wrong_kind_pref",
    "TestOverfullMemory": "overfull_memory",
    "TestGreedyKvDefault": "greedy_kv_default",
    "TestUnseeded": "unseeded",
    "TestFixedSeed": "fixed_seed",
    "TestFp32Cache": "fp32_cache",
    "TestTransposedCache": "transposed_cache",
    "TestBiaslessLinear": "biasless_linear",
    "TestLastMaxArgmax": "last_max_argmax",
    "TestOrderBlindGroupQuant": "order_blind_group_quant",
    "TestSwappedGateUp": "swapped_gate_up",
}

TESTS = "from engine.testing.kit import PlatformTests\n" + "".join(
    f"\nclass {cls}(PlatformTests):\n    plugin = 'broken_platforms'\n    platform_name = {name!r}\n"
    for cls, name in VARIANTS.items()
)

# broken variant -> the kit checks that must fail for it (every other check passes)
DEVICE_CHECKS = (
    "test_declared_dtypes_work",
    "test_memory_info_is_plausible",
    "test_default_kv_cache_fits_in_free_memory",
    "test_memory_stats_count_what_is_allocated",
    "test_seeding_makes_sampling_reproducible",
    "test_kv_cache_allocation",
    "test_linear_method_matches_f_linear",
    "test_linear_method_gate_up_gives_silu_times_up",
    "test_layer_ops_match_the_reference",
)
CAUGHT_BY = {
    "TestSilent": ("test_availability_answers_with_a_reason",),
    "TestBadDtype": ("test_declared_dtypes_work", "test_kv_cache_allocation", "test_layer_ops_match_the_reference"),
    "TestGhostPref": ("test_backend_preferences_resolve_to_registered_backends",),
    "TestDirtyCache": ("test_kv_cache_allocation",),
    "TestFrozenStats": ("test_memory_stats_count_what_is_allocated",),
    # the checks that need the device ask is_available() first, and fail with it
    "TestRaisingProbe": ("test_availability_answers_with_a_reason", *DEVICE_CHECKS),
    "TestForeignPref": ("test_backend_preferences_resolve_to_registered_backends",),
    "TestWrongKindPref": ("test_backend_preferences_resolve_to_registered_backends",),
    "TestOverfullMemory": ("test_memory_info_is_plausible",),
    "TestGreedyKvDefault": ("test_default_kv_cache_fits_in_free_memory",),
    "TestUnseeded": ("test_seeding_makes_sampling_reproducible",),
    "TestFixedSeed": ("test_seeding_makes_sampling_reproducible",),
    "TestFp32Cache": ("test_kv_cache_allocation",),
    "TestTransposedCache": ("test_kv_cache_allocation",),
    "TestBiaslessLinear": ("test_linear_method_matches_f_linear",),
    "TestLastMaxArgmax": ("test_layer_ops_match_the_reference",),
    "TestOrderBlindGroupQuant": ("test_layer_ops_match_the_reference",),
    "TestSwappedGateUp": ("test_linear_method_gate_up_gives_silu_times_up",),
}
NUM_CHECKS = 11


def test_every_broken_platform_is_caught_by_its_check_and_only_there(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(pytester.path))
    # the platforms here inherit engine-cpu's fused layer ops, which ENGINE_CPU_NATIVE=0 (a run
    # of the suite on the torch paths) would take away, and with them the checks of those ops
    monkeypatch.delenv("ENGINE_CPU_NATIVE", raising=False)
    outcomes = run_kit_in_subprocess(pytester, broken_platforms=PLUGIN, test_platform_kit=TESTS)
    for cls, checks in CAUGHT_BY.items():
        for check in checks:
            assert outcomes[(cls, check)] == "failed", f"{cls}: {check} did not fail"
    good = {check: outcome for (cls, check), outcome in outcomes.items() if cls == "TestGood"}
    assert len(good) == NUM_CHECKS and set(good.values()) == {"passed"}, good
    for (cls, check), outcome in outcomes.items():
        if cls in CAUGHT_BY and check not in CAUGHT_BY[cls]:
            assert outcome == "passed", (cls, check, outcome)
    assert {cls for cls, _ in outcomes} == set(VARIANTS), outcomes
