"""The Triton paged-attention kernel (engine.kernels.paged_attention) under the Triton
interpreter: the triton_paged and triton_mla backends through the attention kit's checks
against its naive oracles, on a subset of the kit's cases (the interpreter runs every program
of the grid in Python)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined: run them on the CPU

import dataclasses  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from engine.kernels.paged_attention import TritonMlaAttention, TritonPagedAttention  # noqa: E402
from engine.testing.kit import AttentionBackendTests  # noqa: E402
from engine.testing.kit.attention import BATCHES, MLA, MLA_SIZES  # noqa: E402


def on_the_cpu(cls):
    """The backend on the CPU, through the Triton interpreter (float32)."""
    return type(
        f"Interpreted{cls.__name__}",
        (cls,),
        {
            "capabilities": dataclasses.replace(
                cls.capabilities, platforms=frozenset({"cpu"}), dtypes=frozenset({"float32"})
            ),
        },
    )


class TestTritonPagedKit(AttentionBackendTests):
    """triton_paged: full causal MHA/GQA/MQA in decode, prefill-after-prefix and mixed ragged
    batches, sliding windows across block edges, attention sinks, cache writes; one block size (4, so that
    sequences span many blocks) per case."""

    plugin = "cpu"
    backend_name = "triton_paged"
    dtypes = ("float32",)

    def backend_class(self):
        return on_the_cpu(TritonPagedAttention)

    @pytest.mark.parametrize("batch", BATCHES)
    @pytest.mark.parametrize("heads", ["gqa4", "mqa"])
    def test_mha(self, batch, heads, dtype, engine_device):
        self.check_random_case("mha", batch, 4, heads, None, dtype, engine_device)

    @pytest.mark.parametrize("window", ["w1", "block+1"])
    def test_sliding_window(self, window, dtype, engine_device):
        self.check_random_case("sliding_window", "mixed", 4, "gqa2", window, dtype, engine_device)

    @pytest.mark.parametrize("window", [None, "block+1"])
    def test_attention_sinks(self, window, dtype, engine_device):
        kind, batch = ("sliding_window", "mixed") if window else ("mha", "decode")
        self.check_random_case(kind, batch, 4, "gqa4", window, dtype, engine_device, sinks=True)

    @pytest.mark.parametrize("block_size", [4])
    def test_kv_cache_write(self, block_size, dtype, engine_device):
        super().test_kv_cache_write(block_size, dtype, engine_device)


class TestTritonMlaKit(AttentionBackendTests):
    """triton_mla: latent attention (values the entries' first latent_size dims) in decode,
    prefill and mixed batches, then a decode reading the new entries back."""

    plugin = "cpu"
    backend_name = "triton_mla"
    dtypes = ("float32",)

    def backend_class(self):
        return on_the_cpu(TritonMlaAttention)

    @pytest.mark.parametrize("batch", BATCHES)
    def test_mla(self, batch, dtype, engine_device):
        self.check_mla_case(batch, 4, list(MLA_SIZES)[0], dtype, engine_device, kind=MLA)

    @pytest.mark.parametrize("block_size", [4])
    def test_kv_cache_write(self, block_size, dtype, engine_device):
        super().test_kv_cache_write(block_size, dtype, engine_device)


def paged_case(lengths, block_size, num_kv_heads, head_size, generator):
    """Random keys/values for sequences of the given (context, new) lengths, scattered over
    shuffled blocks of a paged cache; returns the cache views, the block tables, each new
    token's sequence and position, and the unpaged keys/values per sequence."""
    widths = [-(-(c + n) // block_size) for c, n in lengths]
    order = torch.randperm(sum(widths) + 1, generator=generator)  # block ids, one spare
    k_cache = torch.zeros(order.numel(), block_size, num_kv_heads, head_size)
    v_cache = torch.zeros_like(k_cache)
    tables, keys, values, token_seq, token_pos, start = [], [], [], [], [], 0
    for i, ((context, new), width) in enumerate(zip(lengths, widths)):
        table = order[start : start + width]
        start += width
        k = torch.randn(context + new, num_kv_heads, head_size, generator=generator)
        v = torch.randn(context + new, num_kv_heads, head_size, generator=generator)
        for position in range(context + new):
            k_cache[table[position // block_size], position % block_size] = k[position]
            v_cache[table[position // block_size], position % block_size] = v[position]
        tables.append(torch.cat([table, torch.zeros(max(widths) - width, dtype=torch.int64)]))
        keys.append(k)
        values.append(v)
        token_seq += [i] * new
        token_pos += list(range(context, context + new))
    return (k_cache, v_cache, torch.stack(tables), torch.tensor(token_seq), torch.tensor(token_pos), keys, values)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_size", [(3, 3, 24), (6, 2, 40), (5, 1, 16), (8, 4, 8)])
@pytest.mark.parametrize("window", [None, 3])
def test_the_kernel_matches_naive_attention(block_size, num_heads, num_kv_heads, head_size, window):
    """paged_attention on a ragged batch (a decode, a prefill after a cached prefix, a fresh
    prefill) for odd head counts, GQA ratios 1-5, head sizes that are not powers of two and
    block sizes 1-16, against naive_attention over the unpaged keys and values."""
    from engine.kernels.paged_attention import paged_attention
    from engine.testing.oracles import naive_attention

    generator = torch.Generator().manual_seed(block_size * 100 + num_heads * 10 + head_size)
    lengths = [(9, 1), (5, 7), (0, 13)]
    k_cache, v_cache, tables, token_seq, token_pos, keys, values = paged_case(
        lengths, block_size, num_kv_heads, head_size, generator
    )
    q = torch.randn(token_seq.numel(), num_heads, head_size, generator=generator)
    scale = head_size**-0.5
    out = paged_attention(q, k_cache, v_cache, head_size, tables, token_seq, token_pos, scale, window, block_n=8)
    start = 0
    for i, (context, new) in enumerate(lengths):
        expected = naive_attention(q[start : start + new], keys[i], values[i], context, scale, window)
        torch.testing.assert_close(out[start : start + new], expected, atol=1e-3, rtol=0)
        start += new


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("num_heads, latent_size, rope", [(3, 36, 8), (16, 32, 16)])
def test_the_kernel_reads_latent_entries(block_size, num_heads, latent_size, rope):
    """MLA through the same kernel: one latent entry per token as the keys, its first
    latent_size dims as the values, against naive_attention with those keys and values."""
    from engine.kernels.paged_attention import paged_attention
    from engine.testing.oracles import naive_attention

    generator = torch.Generator().manual_seed(num_heads + block_size)
    lengths = [(6, 1), (3, 4)]
    entry = latent_size + rope
    cache, _, tables, token_seq, token_pos, entries, _ = paged_case(lengths, block_size, 1, entry, generator)
    q = torch.randn(token_seq.numel(), num_heads, entry, generator=generator)
    out = paged_attention(q, cache, cache, latent_size, tables, token_seq, token_pos, 0.1, None, block_n=4)
    start = 0
    for i, (context, new) in enumerate(lengths):
        expected = naive_attention(
            q[start : start + new], entries[i], entries[i][..., :latent_size], context, 0.1, None
        )
        torch.testing.assert_close(out[start : start + new], expected, atol=1e-3, rtol=0)
        start += new


def e4m3(x: torch.Tensor, factor: float) -> torch.Tensor:
    """``x`` as an FP8 cache with per-tensor ``factor`` holds it: x / factor rounded to e4m3."""
    return (x / factor).clamp(-448, 448).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("k_scale, v_scale", [(1.0, 1.0), (0.02, 0.5)])
def test_an_fp8_cache_is_read_as_its_entries_times_the_factors(k_scale, v_scale):
    """paged_attention on float8_e4m3fn caches equals naive attention over the dequantized
    entries (entries times the factors), and stays within FP8's rounding of the unquantized
    keys and values."""
    from engine.kernels.paged_attention import paged_attention
    from engine.testing.oracles import naive_attention

    generator = torch.Generator().manual_seed(21)
    lengths = [(9, 1), (5, 7), (0, 13)]
    k_cache, v_cache, tables, token_seq, token_pos, keys, values = paged_case(lengths, 4, 2, 16, generator)
    q = torch.randn(token_seq.numel(), 4, 16, generator=generator)
    k8, v8 = e4m3(k_cache, k_scale), e4m3(v_cache, v_scale)
    out = paged_attention(
        q, k8, v8, 16, tables, token_seq, token_pos, 0.25, None, block_n=8, k_scale=k_scale, v_scale=v_scale
    )
    start = 0
    for i, (context, new) in enumerate(lengths):
        k_back = e4m3(keys[i], k_scale).float() * k_scale
        v_back = e4m3(values[i], v_scale).float() * v_scale
        expected = naive_attention(q[start : start + new], k_back, v_back, context, 0.25, None)
        torch.testing.assert_close(out[start : start + new], expected, atol=1e-4, rtol=0)
        unquantized = naive_attention(q[start : start + new], keys[i], values[i], context, 0.25, None)
        torch.testing.assert_close(out[start : start + new], unquantized, atol=0.15, rtol=0)
        start += new


def test_triton_paged_keeps_an_fp8_cache_when_asked():
    """--kv-cache-dtype fp8: the backend's cache is float8_e4m3fn, a forward writes the new
    keys and values divided by the factors and rounded, and attends over them."""
    from engine.interfaces.attention import MHA, AttentionSpec, CommonAttentionMetadata
    from engine.testing.oracles import naive_attention

    spec = AttentionSpec(kind=MHA, num_heads=4, num_kv_heads=2, head_size=16, scale=0.25)
    backend = on_the_cpu(TritonPagedAttention)(spec, 4, torch.float32, torch.device("cpu"))
    assert backend.cache_dtype(torch.float32) == torch.float32
    backend.kv_cache_dtype, backend.k_scale, backend.v_scale = "fp8", 0.05, 0.25
    assert backend.cache_dtype(torch.float32) == torch.float8_e4m3fn
    cache = torch.zeros(backend.kv_cache_shape(4), dtype=backend.cache_dtype(torch.float32))
    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(6, h, 16, generator=generator) for h in (4, 2, 2))
    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, 6]),
        query_lens=torch.tensor([6]),
        context_lens=torch.tensor([0]),
        seq_lens=torch.tensor([6]),
        block_tables=torch.tensor([[2, 0]]),
        slot_mapping=torch.tensor([8, 9, 10, 11, 0, 1]),
        max_query_len=6,
        max_seq_len=6,
        block_size=4,
    )
    out = backend.forward(q, k, v, cache, backend.build_metadata(common))
    stored_k = cache[0].view(-1, 2, 16)[common.slot_mapping]
    assert torch.equal(stored_k.float(), e4m3(k, 0.05).float())
    assert torch.equal(cache[1].view(-1, 2, 16)[common.slot_mapping].float(), e4m3(v, 0.25).float())
    expected = naive_attention(q, e4m3(k, 0.05).float() * 0.05, e4m3(v, 0.25).float() * 0.25, 0, 0.25, None)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=0)


def test_backends_without_an_fp8_cache_are_refused_with_the_reason():
    from engine.interfaces.attention import MHA, AttentionSpec
    from engine.kernels.paged_attention import TritonMlaAttention

    spec = AttentionSpec(kind=MHA, num_heads=4, num_kv_heads=2, head_size=16, scale=0.25)
    assert (
        TritonPagedAttention.validate(spec, platform="cuda", dtype="bfloat16", block_size=16, kv_cache_dtype="fp8")
        == []
    )
    reasons = TritonMlaAttention.validate(spec, platform="cuda", dtype="bfloat16", block_size=16, kv_cache_dtype="fp8")
    assert "KV-cache dtype fp8 not supported" in reasons
