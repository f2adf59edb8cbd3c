"""The oneDNN linear method against F.linear, and its use by the CPU platform."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import MergedLinear, UnquantizedLinearMethod, VocabEmbedding, apply_linear_method
from engine_cpu import native
from engine_cpu.linear import (
    GEMV_MAX_ROWS,
    OneDNNLinearMethod,
    onednn_available,
    pack_gemv_weight,
    pack_screen_weight,
)
from engine_cpu.platform import CpuPlatform

pytestmark = pytest.mark.skipif(not onednn_available(), reason="torch has no oneDNN bf16 linear on this CPU")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_packed_linear_equals_f_linear(bias, rows):
    gen = torch.Generator().manual_seed(rows)
    layer = MergedLinear(48, [32, 16, 16], bias, torch.bfloat16)
    layer.weight.data.copy_(torch.randn(64, 48, generator=gen))
    if bias:
        layer.bias.data.copy_(torch.randn(64, generator=gen))
    x = torch.randn(rows, 48, generator=gen).bfloat16()
    expected = F.linear(x, layer.weight, layer.bias)
    assert apply_linear_method(layer, OneDNNLinearMethod()) == 1
    assert torch.equal(layer(x), expected)
    assert layer(x.view(1, rows, 48)).shape == (1, rows, 64)


def test_tied_embedding_keeps_its_plain_weight():
    model = nn.Module()
    model.embed = VocabEmbedding(100, 32, torch.bfloat16)
    model.embed.weight.data.normal_()
    model.lm_head = MergedLinear(32, [100], False, torch.bfloat16)
    model.lm_head.weight = model.embed.weight
    ids = torch.tensor([3, 7])
    before = model.embed(ids).clone()
    hidden = torch.randn(2, 32).bfloat16()
    logits = F.linear(hidden, model.embed.weight)
    apply_linear_method(model, OneDNNLinearMethod())
    assert torch.equal(model.embed(ids), before)
    assert torch.equal(model.lm_head(hidden), logits)


def test_platform_packs_bf16_only(monkeypatch):
    platform = CpuPlatform()
    method = platform.linear_method("bfloat16")
    assert isinstance(method, OneDNNLinearMethod)
    kernels = native.load()
    if kernels is not None and kernels.gemv_supported():
        assert method.kernels is kernels and method.copy_budget_bytes == platform.memory_info().total_bytes // 4
    monkeypatch.setenv("ENGINE_CPU_DECODE_GEMV", "0")
    assert platform.linear_method("bfloat16").kernels is None
    assert platform.linear_method("float32") is None


def test_layers_already_given_another_method_are_left_alone():
    class Other(UnquantizedLinearMethod):
        pass

    layer = MergedLinear(8, [8], False, torch.bfloat16, method=Other())
    assert apply_linear_method(layer, OneDNNLinearMethod()) == 0
    assert type(layer.method) is Other


gemv_kernels = pytest.mark.usefixtures("gemv_kernels")


def fp32_reference(x, weight, bias):
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float())


@gemv_kernels
@pytest.mark.parametrize("n, k", [(64, 48), (100, 512), (7, 8), (1000, 1408)])
# passes of 6 rows (4 blocks) or up to 16 (one block), x in sweeps of 192 rows
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 9, 10, 16, 17, 40, 64, 197, 386])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_equals_the_fp32_product_rounded_once(n, k, rows, bias):
    gen = torch.Generator().manual_seed(n * 10 + rows)
    weight = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    x = torch.randn(rows, k, generator=gen).bfloat16()
    out = torch.empty(rows, n, dtype=torch.bfloat16)
    native.load().gemv(out, x, pack_gemv_weight(weight), b if bias else torch.empty(0, dtype=torch.bfloat16))
    expected = fp32_reference(x, weight, b)
    # the fp32 sums differ from the reference's only in order; then one rounding to bf16 (8 bits of mantissa)
    assert torch.allclose(out.float(), expected, rtol=2**-8, atol=1e-3 * expected.abs().max().item())


amx_kernels = pytest.mark.usefixtures("amx_kernels")


@amx_kernels
@pytest.mark.parametrize("n, k", [(64, 48), (100, 512), (7, 8), (1000, 1408), (33, 96), (40, 1000)])
# slices of 16 rows in pairs (a last slice of fewer), x in sweeps of 384 rows at K = 1000 and
# 1024 at K <= 384, and from 128 rows on panels of block pairs (two or more a thread at
# n = 1000, K = 1408) run slice by slice; K in steps of 32
# with a tail of k-pairs; column blocks in pairs (an odd last one)
@pytest.mark.parametrize("rows", [1, 2, 15, 16, 17, 31, 32, 33, 64, 383, 384, 400, 1100])
@pytest.mark.parametrize("bias", [False, True])
def test_amx_linear_equals_the_fp32_product_rounded_once(n, k, rows, bias):
    gen = torch.Generator().manual_seed(n * 10 + rows)
    weight = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    x = torch.randn(rows, k, generator=gen).bfloat16()
    out = torch.full((rows, n), float("nan"), dtype=torch.bfloat16)
    native.load().amx_linear(out, x, pack_gemv_weight(weight), b if bias else torch.empty(0, dtype=torch.bfloat16))
    expected = fp32_reference(x, weight, b)
    assert torch.allclose(out.float(), expected, rtol=2**-8, atol=1e-3 * expected.abs().max().item())


@amx_kernels
def test_amx_linear_rows_do_not_depend_on_the_batch():
    """Each row's sums go 32 k at a time in K's order, whatever slice or sweep holds the row."""
    gen = torch.Generator().manual_seed(7)
    weight = pack_gemv_weight(torch.randn(80, 1000, generator=gen).bfloat16())
    x = torch.randn(300, 1000, generator=gen).bfloat16()
    empty = torch.empty(0, dtype=torch.bfloat16)
    whole = torch.empty(300, 80, dtype=torch.bfloat16)
    native.load().amx_linear(whole, x, weight, empty)
    for start, stop in ((0, 1), (5, 22), (17, 49), (250, 300)):
        part = torch.empty(stop - start, 80, dtype=torch.bfloat16)
        native.load().amx_linear(part, x[start:stop], weight, empty)
        assert torch.equal(part, whole[start:stop])


@amx_kernels
@pytest.mark.parametrize("half, k", [(1408, 512), (48, 1000), (16, 96)])
@pytest.mark.parametrize("rows", [1, 17, 33, 64, 200, 1000])
@pytest.mark.parametrize("bias", [False, True])
def test_amx_gated_linear_is_amx_linear_then_silu_and_mul(half, k, rows, bias):
    """The fused gate/up kernel gives exactly what the two kernels give (each product rounded to
    bf16, silu rounded, times up), and silu(gate) * up within bf16 rounding of the fp32 math."""
    gen = torch.Generator().manual_seed(half + k + rows)
    weight = torch.randn(2 * half, k, generator=gen).bfloat16()
    b = torch.randn(2 * half, generator=gen).bfloat16() if bias else torch.empty(0, dtype=torch.bfloat16)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    packed = pack_gemv_weight(weight)
    kernels = native.load()
    both = torch.empty(rows, 2 * half, dtype=torch.bfloat16)
    kernels.amx_linear(both, x, packed, b)
    expected = torch.empty(rows, half, dtype=torch.bfloat16)
    kernels.silu_and_mul(expected, both)
    fused = torch.full((rows, half), float("nan"), dtype=torch.bfloat16)
    kernels.amx_gated_linear(fused, x, packed, b)
    assert torch.equal(fused, expected)
    products = fp32_reference(x, weight, b if bias else None)
    gate, up = products[:, :half], products[:, half:]
    reference = F.silu(gate) * up
    assert torch.allclose(fused.float(), reference, rtol=2**-6, atol=1e-2 * reference.abs().max().item())


@amx_kernels
def test_amx_gated_linear_refuses_halves_off_a_block_boundary():
    packed = pack_gemv_weight(torch.randn(40, 64).bfloat16())
    with pytest.raises(RuntimeError, match="I % 16 == 0"):
        native.load().amx_gated_linear(
            torch.empty(3, 20, dtype=torch.bfloat16),
            torch.randn(3, 64).bfloat16(),
            packed,
            torch.empty(0, dtype=torch.bfloat16),
        )


@amx_kernels
@pytest.mark.parametrize("n, k", [(32000, 512), (100, 96), (37, 1000)])
@pytest.mark.parametrize("rows", [1, 5, 17, 33, 64, 130, 700])
@pytest.mark.parametrize("bias", [False, True])
def test_amx_linear_argmax_picks_what_argmax_of_amx_linear_picks(n, k, rows, bias):
    """Greedy picks straight from the tiles equal the argmax kernel's over amx_linear's stored
    outputs: columns 3 and n - 2 repeat column 1's weights (equal outputs: the first wins, across
    blocks and threads), and the row with the largest x is also checked with a NaN column."""
    gen = torch.Generator().manual_seed(n + k + rows)
    weight = torch.randn(n, k, generator=gen).bfloat16()
    weight[3] = weight[1]
    weight[n - 2] = weight[1]
    b = torch.randn(n, generator=gen).bfloat16() if bias else torch.empty(0, dtype=torch.bfloat16)
    if bias:
        b[3] = b[n - 2] = b[1]
    x = torch.randn(rows, k, generator=gen).bfloat16()
    kernels = native.load()
    for w in (weight, torch.cat([weight[:-1], torch.full((1, k), float("nan"), dtype=torch.bfloat16)])):
        packed = pack_gemv_weight(w)
        outputs = torch.empty(rows, n, dtype=torch.bfloat16)
        kernels.amx_linear(outputs, x, packed, b)
        expected = torch.empty(rows, dtype=torch.int64)
        kernels.argmax(expected, outputs)
        assert torch.equal(expected, outputs.float().argmax(dim=-1)) or outputs.isnan().any()
        picks = torch.full((rows,), -1, dtype=torch.int64)
        kernels.amx_linear_argmax(picks, x, packed, b, n)
        assert torch.equal(picks, expected)


def plain_screen_weight(weight: torch.Tensor):
    """pack_screen_weight's outputs written out plainly: each output column rounded to int8 by
    its own scale (max |w| / 127), laid out as int8 AMX B tiles (16 columns by 4 k a row)."""
    n, k = weight.shape
    blocks = -(-n // 16)
    qweight = torch.zeros(blocks, k // 4, 16, 4, dtype=torch.int8)
    scale, q1 = torch.zeros(blocks * 16), torch.zeros(blocks * 16)
    for col in range(n):
        w = weight[col].float()
        s = w.abs().max() / 127
        q = torch.zeros(k) if s == 0 else torch.round(w / s).clamp(-127, 127)
        scale[col], q1[col] = s, q.abs().sum()
        qweight[col // 16, :, col % 16, :] = q.to(torch.int8).view(k // 4, 4)
    return qweight, scale, q1


def test_pack_screen_weight_rounds_each_column_to_int8_in_tile_layout():
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(37, 128, generator=gen).bfloat16()
    weight[5] = 0  # a zero column: scale 0, q 0
    empty = torch.empty(0, dtype=torch.bfloat16)
    qweight, scale, q1, max_scale, rowmajor = pack_screen_weight(pack_gemv_weight(weight), 37, empty)
    plain_q, plain_scale, plain_q1 = plain_screen_weight(weight)
    assert torch.equal(rowmajor, weight)
    assert torch.equal(scale, plain_scale) and torch.equal(q1, plain_q1) and max_scale == plain_scale.max().item()
    assert torch.equal(qweight, plain_q)
    # what the kernel cannot screen
    assert pack_screen_weight(pack_gemv_weight(weight[:, :96]), 37, empty) is None  # K % 64
    broken = weight.clone()
    broken[3, 7] = float("inf")
    assert pack_screen_weight(pack_gemv_weight(broken), 37, empty) is None
    assert pack_screen_weight(pack_gemv_weight(weight), 37, torch.full((37,), float("nan")).bfloat16()) is None


@amx_kernels
@pytest.mark.parametrize("n, k", [(32000, 512), (1007, 128), (100, 64)])
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 33, 64, 65, 130])
@pytest.mark.parametrize("bias", [False, True])
def test_screened_argmax_picks_what_amx_linear_argmax_picks(n, k, rows, bias):
    """Screened on int8 copies, the picks are still exactly those of argmax over amx_linear's
    outputs. The weight has near ties the int8 copies cannot tell apart: a column pulled toward
    each row's own direction (so that rows want different columns), a copy of it one bf16 step
    off in one element, and exact copies far apart (equal outputs: the first wins, across
    groups, slices and threads). A zero row, a row with an infinity and a row so large that the
    bound could overflow run unscreened, and the count says so; the others are screened down to
    a small part of the columns."""
    gen = torch.Generator().manual_seed(n + k + rows)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    weight = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
    for r in range(rows):  # a strong column for each row, its copies near it in value
        col = (r * 7919) % (n - 4)
        weight[col] = (x[r].float() / x[r].float().norm()).bfloat16()
        weight[col + 1] = weight[col]
        weight[col + 1, r % k] = torch.nextafter(weight[col, r % k].float(), torch.tensor(2.0)).bfloat16()
    weight[n - 1] = weight[(3 * 7919) % (n - 4)]  # the exact copy of row 3's column, last
    b = torch.randn(n, generator=gen).bfloat16() * 0.1 if bias else torch.empty(0, dtype=torch.bfloat16)
    if bias:
        b[n - 1] = b[(3 * 7919) % (n - 4)]
    special = []
    if rows >= 5:
        x[1] = 0
        x[2, 5] = float("inf")
        x[4] = (x[4].float() * 1e36).bfloat16()
        special = [1, 2, 4]
    kernels = native.load()
    packed = pack_gemv_weight(weight)
    outputs = torch.empty(rows, n, dtype=torch.bfloat16)
    kernels.amx_linear(outputs, x, packed, b)
    expected = torch.empty(rows, dtype=torch.int64)
    kernels.argmax(expected, outputs)
    plain = torch.empty(rows, dtype=torch.int64)
    kernels.amx_linear_argmax(plain, x, packed, b, n)
    assert torch.equal(plain, expected)
    screen = pack_screen_weight(packed, n, b)
    picks = torch.full((rows,), -1, dtype=torch.int64)
    columns, unscreened = kernels.amx_linear_argmax_screened(picks, x, packed, b, n, *screen)
    assert torch.equal(picks, expected)
    assert unscreened == len(special)
    if n > 1000:
        assert columns <= (rows - len(special)) * n // 20
    if rows > 3 and n > 1000:  # the near ties were live: some row's pick is the copy one step off
        assert (picks[3] == (3 * 7919) % (n - 4)) or (picks[3] == (3 * 7919) % (n - 4) + 1)


@amx_kernels
def test_screened_argmax_refuses_what_it_cannot_do():
    kernels = native.load()
    weight = torch.randn(40, 96).bfloat16()
    packed = pack_gemv_weight(weight)
    empty = torch.empty(0, dtype=torch.bfloat16)
    q, scale, q1, _ = torch.zeros(3, 24, 16, 4, dtype=torch.int8), torch.zeros(48), torch.zeros(48), 0
    with pytest.raises(RuntimeError, match="multiple of 64"):
        kernels.amx_linear_argmax_screened(
            torch.empty(2, dtype=torch.int64),
            torch.randn(2, 96).bfloat16(),
            packed,
            empty,
            40,
            q,
            scale,
            q1,
            1.0,
            weight,
        )
    weight = torch.randn(40, 64).bfloat16()
    packed = pack_gemv_weight(weight)
    screen = list(pack_screen_weight(packed, 40, empty))
    screen[0] = screen[0][:2]
    with pytest.raises(RuntimeError, match="qweight must be"):
        kernels.amx_linear_argmax_screened(
            torch.empty(2, dtype=torch.int64), torch.randn(2, 64).bfloat16(), packed, empty, 40, *screen
        )


def test_builds_without_amx_say_so():
    for name in [v.name for v in native.runnable_variants() if "amx_tile" not in v.requires]:
        assert native.load(name) is None or not native.load(name).amx_supported()


@pytest.mark.parametrize("kernel", ["gemv", "amx_linear"])
def test_packed_weight_kernels_reject_what_they_cannot_do(each_isa, kernel):
    kernels = native.load()
    if not (kernels.gemv_supported() if kernel == "gemv" else kernels.amx_supported()):
        pytest.skip(f"the {each_isa} build has no {kernel}")
    run = getattr(kernels, kernel)
    packed = pack_gemv_weight(torch.zeros(16, 8, dtype=torch.bfloat16))
    empty = torch.empty(0, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=f"{kernel}: x and out rows differ"):
        run(torch.empty(5, 16, dtype=torch.bfloat16), torch.zeros(4, 8, dtype=torch.bfloat16), packed, empty)
    with pytest.raises(RuntimeError, match="bf16"):
        run(torch.empty(1, 16), torch.zeros(1, 8), packed, torch.empty(0))
    with pytest.raises(RuntimeError, match="shapes do not match"):
        run(torch.empty(1, 16, dtype=torch.bfloat16), torch.zeros(1, 16, dtype=torch.bfloat16), packed, empty)
    with pytest.raises(RuntimeError, match="bias must be"):
        run(
            torch.empty(1, 16, dtype=torch.bfloat16),
            torch.zeros(1, 8, dtype=torch.bfloat16),
            packed,
            empty[:0].new_zeros(3),
        )


@gemv_kernels
@pytest.mark.parametrize("rows", [1, 4, 5, 64, 65, 300])
def test_linear_method_uses_gemv_for_few_rows_and_onednn_beyond(rows):
    gen = torch.Generator().manual_seed(rows)
    layer = MergedLinear(64, [48, 48], True, torch.bfloat16)
    layer.weight.data.copy_(torch.randn(96, 64, generator=gen))
    layer.bias.data.copy_(torch.randn(96, generator=gen))
    weight, bias = layer.weight.data.clone(), layer.bias.data.clone()
    x = torch.randn(rows, 64, generator=gen).bfloat16()
    apply_linear_method(layer, OneDNNLinearMethod(native.load()))
    assert layer.gemv_weight.shape == (6, 32, 16, 2)
    calls = []
    kernels = layer.method.kernels

    class Spy:
        def gemv(self, *args):
            calls.append(args[1].shape[0])
            return kernels.gemv(*args)

    layer.method.kernels = Spy()
    out = layer(x.view(1, rows, 64))
    assert out.shape == (1, rows, 96)
    assert calls == ([rows] if rows <= GEMV_MAX_ROWS else [])
    expected = fp32_reference(x, weight, bias)
    assert torch.allclose(out[0].float(), expected, rtol=2**-7, atol=1e-2 * expected.abs().max().item())


@gemv_kernels
def test_gemv_copies_stop_at_the_memory_budget():
    method = OneDNNLinearMethod(native.load(), copy_budget_bytes=3000)
    layers = [MergedLinear(32, [32], False, torch.bfloat16) for _ in range(2)]  # 2048 bytes each
    weights = []
    for layer in layers:
        layer.weight.data.normal_()
        weights.append(layer.weight.data.clone())
        apply_linear_method(layer, method)
    assert hasattr(layers[0], "gemv_weight") and not hasattr(layers[1], "gemv_weight")
    x = torch.randn(1, 32).bfloat16()
    for layer, weight in zip(layers, weights):
        expected = fp32_reference(x, weight, None)
        assert torch.allclose(layer(x).float(), expected, rtol=2**-7, atol=1e-2 * expected.abs().max().item())
