"""Kernels chosen by timing them on the model's layers (engine_cpu.tuning)."""

from __future__ import annotations

import json
import time

import pytest
import torch
import torch.nn.functional as F

from engine.layers.linear import MergedLinear, apply_linear_method
from engine_cpu import tuning
from engine_cpu.linear import GEMV_MAX_ROWS, OneDNNLinearMethod, onednn_available


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("ENGINE_CPU_TUNING", "1")
    # the linear method's measurements go here too, not to the user's store
    monkeypatch.setenv("ENGINE_CPU_TUNING_FILE", str(tmp_path / "tuning.json"))
    monkeypatch.setattr(tuning, "BUDGET_SECONDS", float("inf"))
    monkeypatch.setattr(tuning, "MAX_REPEATS", 3)  # the best of three counts
    return tmp_path / "tuning.json"


def layer(n: int, k: int) -> MergedLinear:
    module = MergedLinear(k, [n], False, torch.bfloat16)
    module.weight.data.normal_()
    return module


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def pick_bands(monkeypatch, shape: tuple[int, int], picked: tuple[str, ...]) -> None:
    """The measurement of layers of ``shape`` gives ``picked`` (a kernel name per band)."""
    monkeypatch.setattr(
        tuning,
        "measure",
        lambda layers, candidates, dtype: {
            shape: tuning.Measured(picked, tuple(dict.fromkeys(candidates, 1.0) for _ in picked))
        },
    )


def spy_on_kernels(method: OneDNNLinearMethod) -> list[tuple[str, int]]:
    """(native kernel, rows of its x) of every call the method makes from now on."""
    calls = []
    kernels = method.kernels

    class Spy:
        variant, build = kernels.variant, kernels.build

        def __getattr__(self, name):
            def run(*args):
                calls.append((name, args[1].shape[0]))
                return getattr(kernels, name)(*args)

            return run

    method.kernels = Spy()
    return calls


# measured choices with AMX: gemv, amx, oneDNN, amx, oneDNN by band
AMX_PICKS = ("gemv", "gemv", "amx", "amx", "onednn", "amx", "amx", "amx", "onednn")


def test_band_of_puts_each_row_count_in_its_band():
    assert [tuning.band_of(r) for r in (1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64, 65, 512, 513, 2048, 16384)] == [
        0,
        1,
        2,
        2,
        3,
        3,
        4,
        4,
        5,
        5,
        6,
        6,
        7,  # short prefill chunks
        7,
        8,  # the last band holds every row count beyond 512 (long prefill chunks)
        8,
        8,
    ]


def test_the_fastest_candidate_of_each_band_is_chosen_stored_and_reused(store):
    calls = {"per_row": 0, "flat": 0}

    def per_row(module, x):  # cheap for few rows, dear for many
        calls["per_row"] += 1
        spin(0.0002 * min(x.shape[0], 64))  # 0.2 ms a row (capped: the test's time)
        return x

    def flat(module, x):
        calls["flat"] += 1
        spin(0.0002 * 11.3)  # 8 rows' cost x 1.41, 16 rows' / 1.41
        return x

    layers = [layer(16, 8), layer(32, 8), layer(16, 8)]
    candidates = {"per_row": per_row, "flat": flat}
    chosen = tuning.choose(layers, candidates, torch.bfloat16, "build-1", store)
    assert set(chosen) == {(16, 8), (32, 8)}
    assert chosen[(16, 8)].choice == ("per_row",) * 4 + ("flat",) * 5  # 1..8 rows, then 16+
    assert chosen[(32, 8)].choice == ("per_row",) * 4 + ("flat",) * 5
    assert chosen[(16, 8)].seconds[0]["per_row"] < chosen[(16, 8)].seconds[0]["flat"]
    stored = json.loads(store.read_text())
    (context,) = stored
    assert "threads" in context and "build-1" in context and stored[context]["16x8"]["choice"][-1] == "flat"

    before = dict(calls)
    again = tuning.choose(layers, candidates, torch.bfloat16, "build-1", store)
    assert calls == before and {s: m.choice for s, m in again.items()} == {s: m.choice for s, m in chosen.items()}
    tuning.choose(layers, candidates, torch.bfloat16, "build-2", store)  # another kernel build: measured again
    assert calls["flat"] > before["flat"]


def test_a_candidate_far_slower_everywhere_in_a_band_is_timed_once_there(store):
    """After the first counted repeat, a band stops timing a candidate more than
    OUT_OF_CONTENTION times slower than its fastest for every shape; the others go on."""
    calls = {"fast": 0, "close": 0, "slow": 0, "slow_for_one": 0}

    def timed(name, seconds):
        def kernel(module, x):
            calls[name] += 1
            spin(seconds(module))
            return x

        return kernel

    layers = [layer(16, 8), layer(32, 8)]
    candidates = {
        "fast": timed("fast", lambda m: 0.0004),
        "close": timed("close", lambda m: 0.0006),  # 1.5x: in contention
        "slow": timed("slow", lambda m: 0.004),  # 10x everywhere
        "slow_for_one": timed("slow_for_one", lambda m: 0.004 if m.weight.shape[0] == 16 else 0.0005),
    }
    chosen = tuning.choose(layers, candidates, torch.bfloat16, "build-1", store)
    bands, per_pass = len(tuning.ROW_BANDS), len(tuning.ROW_BANDS) * len(layers)
    passes = 1 + tuning.MAX_REPEATS  # the warm-up and the counted repeats
    assert calls == {
        "fast": passes * per_pass,
        "close": passes * per_pass,
        "slow": 2 * per_pass,
        "slow_for_one": passes * per_pass,
    }
    for shape in ((16, 8), (32, 8)):
        assert chosen[shape].choice == ("fast",) * bands
        assert all(band["slow"] > 5 * band["fast"] for band in chosen[shape].seconds)  # its one counted time


def test_fresh_measures_again_and_a_damaged_store_is_measured_over(store, monkeypatch):
    count = []

    def kernel(module, x):
        count.append(1)
        return x

    layers = [layer(16, 8)]
    tuning.choose(layers, {"a": kernel}, torch.bfloat16, "b", store)
    n = len(count)
    monkeypatch.setenv("ENGINE_CPU_TUNING", "fresh")
    tuning.choose(layers, {"a": kernel}, torch.bfloat16, "b", store)
    assert len(count) == 2 * n
    monkeypatch.setenv("ENGINE_CPU_TUNING", "1")
    store.write_text("{not json")
    assert tuning.choose(layers, {"a": kernel}, torch.bfloat16, "b", store)[(16, 8)].choice == ("a",) * len(
        tuning.ROW_BANDS
    )
    assert len(count) == 3 * n and json.loads(store.read_text())


gemv_kernels = pytest.mark.usefixtures("gemv_kernels")


@gemv_kernels
def test_the_linear_method_follows_the_measured_choice_and_frees_unused_copies(store, monkeypatch):
    from engine_cpu import native

    if not onednn_available():
        pytest.skip("no oneDNN bf16 path on this CPU")
    wide, narrow = layer(96, 64), layer(48, 64)
    weights = {id(m): m.weight.data.clone() for m in (wide, narrow)}
    model = torch.nn.ModuleList([wide, narrow])
    picked = {
        (96, 64): ("gemv", "gemv", "onednn", "gemv", "onednn", "onednn", "onednn", "gemv", "onednn"),
        (48, 64): ("onednn",) * 9,
    }
    monkeypatch.setattr(
        tuning,
        "measure",
        lambda layers, candidates, dtype: {
            s: tuning.Measured(c, tuple({"gemv": 1.0, "onednn": 1.0} for _ in c)) for s, c in picked.items()
        },
    )
    method = OneDNNLinearMethod(native.load())
    apply_linear_method(model, method)
    assert not hasattr(narrow, "gemv_weight")  # never chosen: the copy is given back
    assert [r for r in range(1, GEMV_MAX_ROWS + 1) if wide.packed_kernels[r] == "gemv"] == [1, 2, 5, 6, 7, 8]
    assert wide.packed_beyond == ("gemv", None)  # 65-512 rows, then oneDNN beyond
    assert (
        method.describe()
        == "48x64: onednn 1+; 96x64: gemv 1-2, onednn 3-4, gemv 5-8, onednn 9-64, gemv 65-512, onednn 513+"
    )

    calls = []
    kernels = method.kernels

    class Spy:
        variant, build = kernels.variant, kernels.build

        def gemv(self, *args):
            calls.append(args[1].shape[0])
            return kernels.gemv(*args)

    method.kernels = Spy()
    for rows in (1, 3, 6, 20, 100):
        x = torch.randn(rows, 64).bfloat16()
        for module in (wide, narrow):
            expected = F.linear(x.float(), weights[id(module)].float())
            assert torch.allclose(module(x).float(), expected, rtol=2**-7, atol=1e-2 * expected.abs().max().item())
    assert calls == [1, 6, 100]


@gemv_kernels
def test_measuring_the_real_kernels_gives_a_choice_for_every_shape_and_band(store):
    from engine_cpu import native

    if not onednn_available():
        pytest.skip("no oneDNN bf16 path on this CPU")
    model = torch.nn.ModuleList([layer(256, 128), layer(128, 256), layer(256, 128)])
    method = OneDNNLinearMethod(native.load())
    apply_linear_method(model, method)
    assert set(method.choices) == {(256, 128), (128, 256)}
    for choice in method.choices.values():
        assert len(choice) == len(tuning.ROW_BANDS) and set(choice) <= set(method.candidates())
    assert "256x128:" in method.describe()


def test_tuning_off_keeps_the_fixed_rule(monkeypatch):
    monkeypatch.setenv("ENGINE_CPU_TUNING", "0")
    assert tuning.mode() == "off"
    monkeypatch.setenv("ENGINE_CPU_TUNING", "fresh")
    assert tuning.mode() == "fresh"


@pytest.mark.usefixtures("amx_kernels")
def test_bands_measured_for_amx_run_amx_linear(store, monkeypatch):
    from engine_cpu import native

    if not onednn_available():
        pytest.skip("no oneDNN bf16 path on this CPU")
    layer_ = layer(96, 64)
    weight = layer_.weight.data.clone()
    pick_bands(monkeypatch, (96, 64), AMX_PICKS)
    method = OneDNNLinearMethod(native.load())
    assert set(method.candidates()) == {"gemv", "onednn", "amx"}
    apply_linear_method(torch.nn.ModuleList([layer_]), method)
    assert method.describe() == "96x64: gemv 1-2, amx 3-8, onednn 9-16, amx 17-512, onednn 513+"
    calls = spy_on_kernels(method)
    for rows in (2, 3, 12, 40, 300, 600):
        x = torch.randn(rows, 64).bfloat16()
        expected = F.linear(x.float(), weight.float())
        assert torch.allclose(layer_(x).float(), expected, rtol=2**-7, atol=1e-2 * expected.abs().max().item())
    # 12 rows and 600 rows run oneDNN: no native call
    assert calls == [("gemv", 2), ("amx_linear", 3), ("amx_linear", 40), ("amx_linear", 300)]


def test_a_gate_up_layer_fuses_silu_where_amx_linear_runs(store, monkeypatch):
    """A gated MLP's gate/up layer (two shards of one size) computes silu(gate) * up in one
    kernel in the bands that run amx_linear, and through its chosen kernel then silu_and_mul in
    the others; every band gives the same bits as its kernel followed by silu_and_mul."""
    from engine_cpu import native
    from engine_cpu.ops import NativeLayerOps

    kernels = native.load()
    if not onednn_available() or kernels is None or not kernels.amx_supported():
        pytest.skip("no AMX tiles here")
    gate_up = MergedLinear(64, [48, 48], False, torch.bfloat16)
    gate_up.weight.data.normal_()
    pick_bands(monkeypatch, (96, 64), AMX_PICKS)
    method = OneDNNLinearMethod(kernels)
    apply_linear_method(torch.nn.ModuleList([gate_up]), method)
    ops = NativeLayerOps(kernels)
    calls = spy_on_kernels(method)
    for rows in (2, 3, 12, 40, 300, 600):
        x = torch.randn(rows, 64).bfloat16()
        fused = gate_up.forward_silu_and_mul(x, ops)
        assert torch.equal(fused, ops.silu_and_mul(gate_up.forward(x)))
    ran = [call for call in calls if call[0] == "amx_gated_linear"]
    assert ran == [("amx_gated_linear", 3), ("amx_gated_linear", 40), ("amx_gated_linear", 300)]


@pytest.mark.usefixtures("amx_kernels")
def test_a_model_whose_layers_all_chose_amx_gives_the_fixed_rules_logits(store, monkeypatch, tmp_path):
    """A whole model with every linear layer and band measured for amx_linear (the choice on an
    AMX Xeon): prompt logits within bf16's resolution of the fixed rule's (gemv, then oneDNN),
    and the same greedy tokens as transformers up to a near tie."""
    from engine import LLM
    from engine.testing.checkpoints import make_tiny_checkpoint
    from engine.testing.generation import diverges_only_at_a_near_tie, greedy_tokens, hf_argmax_tokens, random_prompts

    hf_model = make_tiny_checkpoint("LlamaForCausalLM", tmp_path / "llama", dtype="bfloat16")
    batch = random_prompts(5, lengths=(3, 40, 70))  # decode rows, and prompts past a 32-row tile pass

    def make_llm():
        path = str(tmp_path / "llama")
        return LLM(path, plugins=["cpu", "llama"], dtype="bfloat16", kv_cache_memory=0.02, progress=False)

    monkeypatch.setenv("ENGINE_CPU_TUNING", "0")
    fixed = make_llm()
    fixed_logits = fixed.prompt_logits(batch)
    monkeypatch.setenv("ENGINE_CPU_TUNING", "1")
    monkeypatch.setattr(
        tuning,
        "measure",
        lambda layers, candidates, dtype: {
            tuning.shape_of(m): tuning.Measured(
                ("amx",) * len(tuning.ROW_BANDS), tuple({"amx": 1.0} for _ in tuning.ROW_BANDS)
            )
            for m in layers
        },
    )
    amx = make_llm()
    layers = [m for m in amx.engine.runner.model.modules() if isinstance(m, MergedLinear)]
    assert layers and all(m.packed_kernels[1:] == ("amx_linear",) * GEMV_MAX_ROWS for m in layers)
    assert all(m.packed_beyond == ("amx_linear", "amx_linear") for m in layers)
    for a, b in zip(amx.prompt_logits(batch), fixed_logits):
        assert (a - b).abs().max().item() <= 2**-6 * b.abs().max().item()
    tokens = greedy_tokens(amx, batch, 16)
    for prompt, ours in zip(batch, tokens):
        assert diverges_only_at_a_near_tie(hf_model, prompt, ours, hf_argmax_tokens(hf_model, prompt, 16))


def test_an_lm_head_picks_greedy_tokens_without_logits_where_amx_linear_runs(store, monkeypatch):
    """gather_argmax runs amx_linear_argmax in the bands that run amx_linear and gives exactly
    the argmax of the head's logits there; elsewhere it declines (None) and the logits decide."""
    from engine.layers.linear import ParallelLMHead, gather_argmax, gather_logits
    from engine_cpu import native

    kernels = native.load()
    if not onednn_available() or kernels is None or not kernels.amx_supported():
        pytest.skip("no AMX tiles here")
    head = ParallelLMHead(64, 300, torch.bfloat16)
    head.weight.data.normal_()
    pick_bands(monkeypatch, (300, 64), AMX_PICKS)
    method = OneDNNLinearMethod(kernels)
    apply_linear_method(torch.nn.ModuleList([head]), method)
    calls = spy_on_kernels(method)
    for rows in (2, 3, 12, 40, 300, 600):
        x = torch.randn(rows, 64).bfloat16()
        picks = gather_argmax(head, x)
        if rows in (3, 40, 300):
            assert torch.equal(picks, gather_logits(head, x).float().argmax(dim=-1))
        else:
            assert picks is None
    ran = [call for call in calls if call[0] == "amx_linear_argmax"]
    assert ran == [("amx_linear_argmax", 3), ("amx_linear_argmax", 40), ("amx_linear_argmax", 300)]


def test_a_head_picks_on_its_int8_screen_in_the_bands_where_timing_found_it_faster(store, monkeypatch):
    """At the head's first greedy pick the two pick kernels are timed per band (stored like the
    linear kernels' choices); the bands where the screened one won run it, with the same picks
    as the head's logits, and describe() reports the choice."""
    from engine.layers.linear import ParallelLMHead, gather_argmax, gather_logits
    from engine_cpu import native

    kernels = native.load()
    if not onednn_available() or kernels is None or not kernels.amx_supported():
        pytest.skip("no AMX tiles here")
    greedy = ("amx", "amx", "screened", "screened", "amx", "amx", "screened", "amx", "amx")
    timed = []

    def measure(layers, candidates, dtype):
        timed.append(sorted(candidates))
        picked = greedy if "screened" in candidates else AMX_PICKS
        for kernel in candidates.values():  # every candidate runs
            kernel(layers[0], torch.randn(5, 64).bfloat16())
        return {(300, 64): tuning.Measured(picked, tuple(dict.fromkeys(candidates, 1.0) for _ in picked))}

    monkeypatch.setattr(tuning, "measure", measure)
    head = ParallelLMHead(64, 300, torch.bfloat16)
    head.weight.data.normal_()
    weight = head.weight.data.clone()
    method = OneDNNLinearMethod(kernels)
    apply_linear_method(torch.nn.ModuleList([head]), method)
    calls = spy_on_kernels(method)
    for rows in (3, 40, 300):
        x = torch.randn(rows, 64).bfloat16()
        assert torch.equal(gather_argmax(head, x), gather_logits(head, x).float().argmax(dim=-1))
    assert timed == [["amx", "gemv", "onednn"], ["amx", "screened"]]
    ran = [call for call in calls if call[0].startswith("amx_linear_argmax") and call[1] in (3, 40, 300)]
    assert ran[-3:] == [
        ("amx_linear_argmax_screened", 3),
        ("amx_linear_argmax_screened", 40),
        ("amx_linear_argmax", 300),
    ]
    assert method.describe().endswith("; greedy picks 300x64: amx 1-2, screened 3-8, amx 9-32, screened 33-64, amx 65+")
    # a second start reads the choice from the store and times nothing
    head2 = ParallelLMHead(64, 300, torch.bfloat16)
    head2.weight.data.copy_(weight)
    method2 = OneDNNLinearMethod(kernels)
    apply_linear_method(torch.nn.ModuleList([head2]), method2)
    x = torch.randn(3, 64).bfloat16()
    assert torch.equal(gather_argmax(head2, x), gather_logits(head2, x).float().argmax(dim=-1))
    assert len(timed) == 2
