"""cpu_paged against naive softmax attention over the unpaged K/V."""

from __future__ import annotations

import math

import pytest
import torch
from cpu_isa import ISA_VARIANTS, use_isa

from engine.interfaces.attention import MHA, SLIDING_WINDOW, AttentionSpec, CommonAttentionMetadata
from engine_cpu.attention import CpuPagedAttention


def naive_attention(q, k, v, context_len, scale, window, sinks=None):
    """q: [n, H, D] at positions context_len..; k, v: [L, Hkv, D] for positions 0..L-1; sinks:
    [H] logits, each one more term of its head's softmax that adds no value (or None)."""
    n, num_heads, _ = q.shape
    group = num_heads // k.shape[1]
    out = torch.empty_like(q)
    for i in range(n):
        pos = context_len + i
        for h in range(num_heads):
            keys = k[: pos + 1, h // group].float()
            values = v[: pos + 1, h // group].float()
            scores = keys @ q[i, h].float() * scale
            if window is not None:
                scores[: max(0, pos + 1 - window)] = -math.inf
            if sinks is not None:
                weights = torch.cat([scores, sinks[h : h + 1].float()]).softmax(0)[:-1]
            else:
                weights = scores.softmax(0)
            out[i, h] = (weights @ values).to(q.dtype)
    return out


@pytest.fixture(params=[*(f"native-{isa}" for isa in ISA_VARIANTS), "torch"])
def path(request, monkeypatch):
    """Which implementation of the backend runs: the C++ kernels of one instruction-set variant,
    or the torch fallback."""
    if request.param != "torch":
        use_isa(monkeypatch, request.param.removeprefix("native-"))
    return request.param


def make_backend(spec, block_size, dtype, path, batch_invariant=False):
    backend = CpuPagedAttention(spec, block_size, dtype, torch.device("cpu"))
    backend.batch_invariant = batch_invariant
    if path == "torch":
        backend.kernels = None
    elif backend.kernels is None and not spec.sinks:  # sinks without the packed layout: torch by design
        pytest.fail("the engine-cpu native kernels failed to build (see the engine.cpu log)")
    return backend


def slot_views(backend, cache, slot):
    """Views of one slot's K and V ([Hkv, D] each, or [Hkv, D/2, 2] for packed keys), by the
    layout the module docstring describes."""
    spec, bs = backend.spec, backend.block_size
    block, offset = divmod(slot, bs)
    if not backend.packed:  # [K/V, block, offset, kv head, D]
        return cache[0, block, offset], cache[1, block, offset]
    # per (block, kv head): keys [D/2][block_size][2], values [block_size/2][D][2]
    keys = cache[0, block].view(spec.num_kv_heads, spec.head_size // 2, bs, 2)[:, :, offset]
    values = cache[1, block].view(spec.num_kv_heads, bs // 2, spec.head_size, 2)[:, offset // 2, :, offset % 2]
    return keys, values


def write_slot(backend, cache, slot, k, v):
    keys, values = slot_views(backend, cache, slot)
    keys.copy_(k.view(keys.shape))
    values.copy_(v)


def read_slot(backend, cache, slot):
    keys, values = slot_views(backend, cache, slot)
    return keys.reshape(values.shape), values


def run_case(
    *,
    seed,
    context_lens,
    query_lens,
    num_heads,
    num_kv_heads,
    head_size,
    block_size,
    window,
    dtype,
    path,
    fused_qkv=False,
    batch_invariant=False,
    sinks=False,
):
    gen = torch.Generator().manual_seed(seed)
    spec = AttentionSpec(
        kind=SLIDING_WINDOW if window else MHA,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        scale=head_size**-0.5,
        sliding_window=window,
        sinks=sinks,
    )
    backend = make_backend(spec, block_size, dtype, path, batch_invariant)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    # scatter each sequence over random physical blocks
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, start = [], 0
    for nb in blocks_per_seq:
        tables.append(perm[start : start + nb])
        start += nb
    width = max(blocks_per_seq)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])

    cache = torch.randn(backend.kv_cache_shape(num_blocks), generator=gen).to(dtype)  # stale garbage everywhere
    full_k = [torch.randn(s, num_kv_heads, head_size, generator=gen).to(dtype) for s in seq_lens]
    full_v = [torch.randn(s, num_kv_heads, head_size, generator=gen).to(dtype) for s in seq_lens]

    def slot(seq, pos):
        return tables[seq][pos // block_size] * block_size + pos % block_size

    for b, c in enumerate(context_lens):  # the cached prefix, written independently of the backend
        for pos in range(c):
            write_slot(backend, cache, slot(b, pos), full_k[b][pos], full_v[b][pos])

    qs = [torch.randn(n, num_heads, head_size, generator=gen).to(dtype) for n in query_lens]
    q = torch.cat(qs)
    k = torch.cat([full_k[b][c:] for b, c in enumerate(context_lens)])
    v = torch.cat([full_v[b][c:] for b, c in enumerate(context_lens)])
    slot_mapping = torch.tensor(
        [slot(b, c + i) for b, (c, n) in enumerate(zip(context_lens, query_lens)) for i in range(n)]
    )
    query_start_loc = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0)))
    common = CommonAttentionMetadata(
        query_start_loc=query_start_loc,
        query_lens=torch.tensor(query_lens),
        context_lens=torch.tensor(context_lens),
        seq_lens=torch.tensor(seq_lens),
        block_tables=block_tables,
        slot_mapping=slot_mapping,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
    )
    if fused_qkv:  # q, k and v as column slices of one projection's output, as models pass them
        qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
        parts = qkv.split([q[0].numel(), k[0].numel(), v[0].numel()], dim=1)
        q, k, v = (
            part.view(-1, heads, head_size) for part, heads in zip(parts, (num_heads, num_kv_heads, num_kv_heads))
        )
        assert not q.is_contiguous()
    # sink logits around the scores' range: from a little to most of a head's weight
    sink_logits = torch.randn(num_heads, generator=gen) * 2 + 1 if sinks else None
    out = backend.forward(q, k, v, cache, backend.build_metadata(common), sinks=sink_logits)

    expected = torch.cat(
        [
            naive_attention(qs[b], full_k[b], full_v[b], c, spec.scale, window, sink_logits)
            for b, c in enumerate(context_lens)
        ]
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert out.shape == q.shape
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
    # the new keys and values were written into their slots
    for i, s in enumerate(slot_mapping.tolist()):
        written_k, written_v = read_slot(backend, cache, s)
        torch.testing.assert_close(written_k, k[i])
        torch.testing.assert_close(written_v, v[i])


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_prefill_with_cached_prefix(seed, block_size, num_heads, num_kv_heads, path):
    gen = torch.Generator().manual_seed(seed)
    num_seqs = int(torch.randint(1, 5, (1,), generator=gen))
    context_lens = torch.randint(0, 30, (num_seqs,), generator=gen).tolist()
    query_lens = torch.randint(1, 20, (num_seqs,), generator=gen).tolist()
    run_case(
        seed=seed,
        context_lens=context_lens,
        query_lens=query_lens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=16,
        block_size=block_size,
        window=None,
        dtype=torch.float32,
        path=path,
    )


@pytest.mark.parametrize("block_size", [4, 16])
def test_batched_decode(block_size, path):
    run_case(
        seed=11,
        context_lens=[0, 5, 31, 64, 7, 100],
        query_lens=[1] * 6,
        num_heads=8,
        num_kv_heads=2,
        head_size=32,
        block_size=block_size,
        window=None,
        dtype=torch.float32,
        path=path,
    )


def test_mixed_decode_and_prefill_batch(path):
    run_case(
        seed=12,
        context_lens=[40, 0, 17, 3],
        query_lens=[1, 25, 1, 9],
        num_heads=4,
        num_kv_heads=2,
        head_size=8,
        block_size=8,
        window=None,
        dtype=torch.float32,
        path=path,
    )


@pytest.mark.parametrize("window", [1, 5, 16])
def test_sliding_window(window, path):
    run_case(
        seed=13,
        context_lens=[0, 20, 33],
        query_lens=[30, 1, 12],
        num_heads=4,
        num_kv_heads=2,
        head_size=16,
        block_size=4,
        window=window,
        dtype=torch.float32,
        path=path,
    )


def test_bfloat16(path):
    run_case(
        seed=14,
        context_lens=[10, 0],
        query_lens=[6, 12],
        num_heads=4,
        num_kv_heads=2,
        head_size=64,
        block_size=16,
        window=None,
        dtype=torch.bfloat16,
        path=path,
    )


@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
@pytest.mark.parametrize(
    "context_lens,query_lens,num_heads,num_kv_heads,window",
    [
        ([0, 5, 17, 300], [1, 1, 1, 1], 4, 4, None),  # decodes, ragged contexts up to 19 blocks of 16
        ([31, 64, 2], [1, 3, 15], 4, 2, None),  # decodes and short chunks, GQA
        ([100, 40], [1, 7], 8, 1, None),  # MQA
        ([100, 40, 9], [1, 2, 1], 4, 2, 23),  # sliding window across block edges
    ],
)
def test_bf16_decode_and_short_chunks(
    path, head_size, block_size, context_lens, query_lens, num_heads, num_kv_heads, window
):
    """Rows of fewer than 16 queries in bf16 go to the paged kernel: heads of 64 and 128, every block size."""
    run_case(
        seed=31,
        context_lens=context_lens,
        query_lens=query_lens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        block_size=block_size,
        window=window,
        dtype=torch.bfloat16,
        path=path,
    )


def test_validate_reports_unsupported_requests():
    spec = AttentionSpec(kind="mla", num_heads=4, num_kv_heads=4, head_size=16, scale=0.25)
    reasons = CpuPagedAttention.validate(spec, platform="rocm", dtype="float8", block_size=16)
    assert len(reasons) == 3
    assert any("attention kind 'mla'" in r for r in reasons)
    assert any("platform 'rocm'" in r for r in reasons)
    assert any("dtype float8" in r for r in reasons)
    ok = AttentionSpec(kind=MHA, num_heads=4, num_kv_heads=2, head_size=16, scale=0.25)
    assert CpuPagedAttention.validate(ok, platform="cpu", dtype="bfloat16", block_size=16) == []


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize(
    "context_lens,query_lens,num_heads,num_kv_heads,window",
    [
        ([0], [70], 4, 4, None),  # one long prompt
        ([0, 33, 5], [16, 40, 17], 4, 2, None),  # cached prefixes, ragged, GQA
        ([20, 0], [50, 31], 8, 1, None),  # MQA
        ([10, 0], [40, 64], 4, 2, 13),  # sliding window
        ([3], [16], 2, 2, 40),
    ],
)
def test_long_prefill_chunks_in_bf16(path, block_size, context_lens, query_lens, num_heads, num_kv_heads, window):
    """Chunks of 16+ queries take the long-prefill path on the native side."""
    run_case(
        seed=21,
        context_lens=context_lens,
        query_lens=query_lens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=64,
        block_size=block_size,
        window=window,
        dtype=torch.bfloat16,
        path=path,
    )


@pytest.mark.parametrize("head_size", [16, 32, 128, 256])
@pytest.mark.parametrize("block_size", [16, 48])
def test_packed_cache_head_sizes(path, head_size, block_size):
    """Every head size of the packed layout, decodes and long and short chunks after cached prefixes."""
    run_case(
        seed=23,
        context_lens=[0, 40, 7, 61],
        query_lens=[33, 1, 5, 20],
        num_heads=4,
        num_kv_heads=2,
        head_size=head_size,
        block_size=block_size,
        window=None,
        dtype=torch.bfloat16,
        path=path,
    )


@pytest.mark.parametrize(
    "dtype,head_size,block_size,packed",
    [
        (torch.bfloat16, 64, 16, True),
        (torch.bfloat16, 64, 8, False),
        (torch.bfloat16, 48, 16, False),
        (torch.float32, 64, 16, False),
    ],
)
def test_gather_and_scatter_kv_follow_the_layout(dtype, head_size, block_size, packed):
    """gather_kv / scatter_kv read and write the slots where the kernels expect them."""
    spec = AttentionSpec(kind=MHA, num_heads=4, num_kv_heads=2, head_size=head_size, scale=0.125)
    backend = make_backend(spec, block_size, dtype, "native")
    assert backend.packed == (packed and backend.kernels.packed_kv_supported(64, 16))
    gen = torch.Generator().manual_seed(5)
    cache = torch.zeros(backend.kv_cache_shape(6), dtype=dtype)
    slots = torch.tensor([0, 7, block_size + 3, 5 * block_size + block_size - 1])
    k, v = (torch.randn(len(slots), 2, head_size, generator=gen).to(dtype) for _ in range(2))
    backend.scatter_kv(cache, slots, k, v)
    for i, s in enumerate(slots.tolist()):
        torch.testing.assert_close(read_slot(backend, cache, s), (k[i], v[i]))
    gathered = backend.gather_kv(cache, slots)
    torch.testing.assert_close(gathered, (k, v))
    assert cache.count_nonzero() == k.count_nonzero() + v.count_nonzero()  # nothing else written


def test_native_cache_write_packed_refuses_a_slot_outside_the_cache():
    from engine_cpu import native

    kernels = native.load()
    if kernels is None or not kernels.packed_kv_supported(16, 16):
        pytest.skip("packed layout unavailable on this CPU")
    cache = torch.zeros(2, 2, 1, 16 * 16, dtype=torch.bfloat16)
    k = torch.ones(1, 1, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="slot 32 out of range"):
        kernels.cache_write_packed(cache, torch.tensor([32]), k, k)


@pytest.mark.parametrize("fused_qkv", [False, True])
def test_long_and_short_chunks_and_decodes_in_one_batch(path, fused_qkv):
    run_case(
        seed=22,
        context_lens=[0, 40, 7, 100],
        query_lens=[48, 1, 5, 20],
        num_heads=4,
        num_kv_heads=2,
        head_size=64,
        block_size=16,
        window=None,
        dtype=torch.bfloat16,
        path=path,
        fused_qkv=fused_qkv,
    )


def test_native_cache_write_refuses_a_slot_outside_the_cache():
    from engine_cpu import native

    kernels = native.load()
    if kernels is None:
        pytest.skip("native kernels unavailable")
    cache = torch.zeros(8, 2, 4)
    k = torch.ones(1, 2, 4)
    with pytest.raises(RuntimeError, match="slot 8 out of range"):
        kernels.cache_write(cache, cache.clone(), torch.tensor([8]), k, k)
    kernels.cache_write(cache, cache.clone(), torch.tensor([3]), k, k)
    assert cache[3].eq(1).all() and cache.sum() == 8


def test_native_packed_cache_write_is_exact_when_threads_share_blocks():
    """Tokens of one value pair written by different threads at the same time lose nothing:
    the threads take halves of the tokens, and token i of the first half and token i of the
    second go to the two keys of one pair."""
    spec = AttentionSpec(kind=MHA, num_heads=2, num_kv_heads=2, head_size=64, scale=0.125)
    backend = make_backend(spec, 16, torch.bfloat16, "native")
    if not backend.packed:
        pytest.skip("packed layout unavailable on this CPU")
    gen = torch.Generator().manual_seed(9)
    num_tokens = 4096
    half = torch.arange(num_tokens // 2)
    slots = torch.cat([2 * half, 2 * half + 1])
    k, v = (torch.randn(num_tokens, 2, 64, generator=gen).bfloat16() for _ in range(2))
    for _ in range(20):
        cache = torch.zeros(backend.kv_cache_shape(num_tokens // 16 + 2), dtype=torch.bfloat16)
        backend.kernels.cache_write_packed(cache, slots, k, v)
        got_k, got_v = backend.gather_kv(cache, slots)
        assert torch.equal(got_k, k) and torch.equal(got_v, v)


@pytest.mark.parametrize(
    ("head_size", "block_size", "row_pad"), [(64, 16, 0), (128, 32, 0), (32, 16, 0), (16, 16, 0), (64, 16, 1)]
)
def test_native_packed_cache_write_of_prompt_runs_matches_the_layout(head_size, block_size, row_pad):
    """A prompt chunk's tokens fill 16-slot runs of their blocks, which the kernel writes whole;
    the tokens around them (a chunk that starts or ends inside a run, a run cut by the batch's
    end, slots out of order) one by one. Every slot holds its token's K and V by the layout
    written out plainly in slot_views, and no other slot is touched. k and v are slices of one
    fused projection (row_pad 1: an odd row stride, which takes the token-by-token path)."""
    spec = AttentionSpec(kind=MHA, num_heads=4, num_kv_heads=2, head_size=head_size, scale=0.125)
    backend = make_backend(spec, block_size, torch.bfloat16, "native")
    if not backend.packed:
        pytest.skip("packed layout unavailable on this CPU")
    gen = torch.Generator().manual_seed(3)
    num_blocks = 40
    # runs of slots: a whole prompt from a block's start, chunks starting and ending inside runs,
    # a decode token, a run written backwards, and a prompt that ends the batch inside a run
    runs = [
        (0, 70),
        (5 * block_size + 7, 41),
        (9 * block_size + 3, 1),
        (12 * block_size, 16),
        (15 * block_size + 16 % block_size, 50),
        (25 * block_size, 37),
    ]
    slots = torch.cat(
        [torch.arange(start, start + n) for start, n in runs[:3]]
        + [torch.arange(runs[3][0], runs[3][0] + runs[3][1]).flip(0)]
        + [torch.arange(start, start + n) for start, n in runs[4:]]
    )
    num_tokens, width = len(slots), 2 * 2 * head_size
    fused = torch.randn(num_tokens, 4 * head_size + width + row_pad, generator=gen).bfloat16()
    k = fused[:, 4 * head_size : 6 * head_size].view(num_tokens, 2, head_size)
    v = fused[:, 6 * head_size : 8 * head_size].view(num_tokens, 2, head_size)
    cache = torch.zeros(backend.kv_cache_shape(num_blocks), dtype=torch.bfloat16)
    backend.kernels.cache_write_packed(cache, slots, k, v)
    expected = torch.zeros_like(cache)
    for t, slot in enumerate(slots.tolist()):
        write_slot(backend, expected, slot, k[t], v[t])
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_batch_invariant_mode_still_computes_attention(path, dtype):
    """--batch-invariant routes every row to one kernel: still attention, for long chunks,
    cached prefixes, GQA and windows alike."""
    for context_lens, query_lens, window in [([0, 33, 5], [40, 16, 1], None), ([10, 0], [40, 20], 13)]:
        run_case(
            seed=5,
            context_lens=context_lens,
            query_lens=query_lens,
            num_heads=4,
            num_kv_heads=2,
            head_size=64,
            block_size=16,
            window=window,
            dtype=dtype,
            path=path,
            batch_invariant=True,
        )


def attend_rows(backend, cache, tables, seqs, q_of, kv_of):
    """Attention of ``seqs`` = [(sequence, first query position, query count)] in one step, the
    keys and values of every earlier position already in ``cache``; returns each sequence's rows."""
    bs = backend.block_size
    query_lens = [n for _, _, n in seqs]
    context_lens = [c for _, c, _ in seqs]
    width = max(len(tables[b]) for b, _, _ in seqs)
    block_tables = torch.tensor([tables[b] + [0] * (width - len(tables[b])) for b, _, _ in seqs])
    slots = [tables[b][p // bs] * bs + p % bs for b, c, n in seqs for p in range(c, c + n)]
    q = torch.cat([q_of[b][c : c + n] for b, c, n in seqs])
    k = torch.cat([kv_of[b][0][c : c + n] for b, c, n in seqs])
    v = torch.cat([kv_of[b][1][c : c + n] for b, c, n in seqs])
    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0))),
        query_lens=torch.tensor(query_lens),
        context_lens=torch.tensor(context_lens),
        seq_lens=torch.tensor([c + n for c, n in zip(context_lens, query_lens)]),
        block_tables=block_tables,
        slot_mapping=torch.tensor(slots),
        max_query_len=max(query_lens),
        max_seq_len=max(c + n for c, n in zip(context_lens, query_lens)),
        block_size=bs,
    )
    out = backend.forward(q, k, v, cache, backend.build_metadata(common))
    return out.split(query_lens)


@pytest.mark.parametrize("window", [None, 24])
def test_batch_invariant_rows_are_bitwise_the_same_in_any_batch_and_any_chunking(path, window):
    """A token's attention output in bf16 must not depend on what else is in the step, nor on
    how its prompt was cut into chunks: alone, as one 60-token prefill, as chunks of 7 and 16
    beside other sequences, and as decode steps."""
    gen = torch.Generator().manual_seed(11)
    spec = AttentionSpec(
        kind=SLIDING_WINDOW if window else MHA,
        num_heads=4,
        num_kv_heads=2,
        head_size=64,
        scale=0.125,
        sliding_window=window,
    )
    bs, dtype = 16, torch.bfloat16
    backend = make_backend(spec, bs, dtype, path, batch_invariant=True)
    lengths = [60, 45, 30]
    blocks = [-(-n // bs) for n in lengths]
    perm = torch.randperm(sum(blocks) + 2, generator=gen).tolist()
    tables = [perm[sum(blocks[:i]) : sum(blocks[: i + 1])] for i in range(len(lengths))]
    cache = torch.zeros(backend.kv_cache_shape(sum(blocks) + 2), dtype=dtype)
    q_of = [torch.randn(n, 4, 64, generator=gen).to(dtype) for n in lengths]
    kv_of = [tuple(torch.randn(n, 2, 64, generator=gen).to(dtype) for _ in range(2)) for n in lengths]

    whole = attend_rows(backend, cache, tables, [(0, 0, 60)], q_of, kv_of)[0]
    pieces = []
    for start, n in [(0, 7), (7, 16), (23, 1), (24, 30), (54, 6)]:  # with the other sequences beside it
        others = [(1, 0, 45), (2, 0, 30)] if start == 0 else [(1, 44, 1), (2, 29, 1)]
        pieces.append(attend_rows(backend, cache, tables, [*others[:1], (0, start, n), *others[1:]], q_of, kv_of)[1])
    decode = [attend_rows(backend, cache, tables, [(0, p, 1)], q_of, kv_of)[0] for p in range(60)]
    assert torch.equal(torch.cat(pieces), whole)
    assert torch.equal(torch.cat(decode), whole)


@pytest.mark.parametrize(
    "context_lens,query_lens,num_heads,num_kv_heads,window",
    [
        ([40, 7, 0], [1, 1, 1], 8, 2, None),  # decodes, GQA
        ([0, 33, 5], [16, 40, 3], 4, 2, None),  # long chunks after cached prefixes, a short one
        ([10, 0], [40, 64], 4, 4, 13),  # sliding window (GPT-OSS alternates it)
    ],
)
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_attention_sinks_in_bf16(path, context_lens, query_lens, num_heads, num_kv_heads, window, batch_invariant):
    """Sinks (GPT-OSS): the packed kernels put each head's sink in its max and sum (decode, short
    and long chunks, AMX or AVX-512 prefill, batch invariant); the torch path as well."""
    run_case(
        seed=31,
        context_lens=context_lens,
        query_lens=query_lens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=64,
        block_size=16,
        window=window,
        dtype=torch.bfloat16,
        path=path,
        batch_invariant=batch_invariant,
        sinks=True,
    )


def test_sinks_run_the_packed_kernels_and_only_them():
    """A layer with sinks keeps the native kernels where the cache is packed (bf16), and takes
    the torch path where it is not (fp32)."""
    spec = AttentionSpec(kind=MHA, num_heads=4, num_kv_heads=2, head_size=64, scale=0.125, sinks=True)
    packed = CpuPagedAttention(spec, 16, torch.bfloat16, torch.device("cpu"))
    if packed.kernels is None:
        pytest.skip("no native kernels here")
    if not packed.kernels.packed_kv_supported(64, 16):
        assert not packed.packed and packed.kernels is None
        pytest.skip("this build has no packed layout")
    assert packed.packed and packed.kernels is not None
    plain = CpuPagedAttention(spec, 16, torch.float32, torch.device("cpu"))
    assert plain.kernels is None and not plain.packed


@pytest.mark.parametrize("window", [None, 21])
@pytest.mark.parametrize("sinks", [False, True])
def test_decode_steps_write_and_attend_in_one_kernel_as_in_two(window, sinks):
    """A step of decode tokens alone (bf16, packed cache) goes to decode_attention_packed, which
    writes each token's keys and values as it attends: the same outputs, bit for bit, and the
    same cache as the separate write and paged kernel of mixed steps."""
    from engine_cpu import native

    spec = AttentionSpec(
        kind=SLIDING_WINDOW if window else MHA,
        num_heads=8,
        num_kv_heads=2,
        head_size=64,
        scale=0.125,
        sliding_window=window,
        sinks=sinks,
    )
    backend = make_backend(spec, 16, torch.bfloat16, "native")
    if not backend.packed:
        pytest.skip("packed layout unavailable on this CPU")
    gen = torch.Generator().manual_seed(41)
    num_seqs, num_blocks = 40, 220
    context_lens = torch.randint(0, 80, (num_seqs,), generator=gen)
    tables = torch.randperm(num_blocks, generator=gen)[: num_seqs * 5].view(num_seqs, 5)
    slots = tables[torch.arange(num_seqs), context_lens // 16] * 16 + context_lens % 16
    common = CommonAttentionMetadata(
        query_start_loc=torch.arange(num_seqs + 1),
        query_lens=torch.ones(num_seqs, dtype=torch.int64),
        context_lens=context_lens,
        seq_lens=context_lens + 1,
        block_tables=tables,
        slot_mapping=slots,
        max_query_len=1,
        max_seq_len=int(context_lens.max()) + 1,
        block_size=16,
    )
    qkv = torch.randn(num_seqs, 12 * 64, generator=gen).bfloat16()  # q, k, v as slices of one projection
    q, k, v = (part.view(num_seqs, -1, 64) for part in qkv.split([512, 128, 128], dim=1))
    sink_logits = torch.randn(8, generator=gen) if sinks else None
    cache = torch.randn(backend.kv_cache_shape(num_blocks), generator=gen).bfloat16()
    two_pass = cache.clone()
    metadata = backend.build_metadata(common)
    assert metadata.decode_only

    calls = []
    kernels = native.load()

    class Spy:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(kernels, name)

    backend.kernels = Spy()
    calls.clear()  # the setter asks about the layout
    out = backend.forward(q, k, v, cache, metadata, sinks=sink_logits)
    assert calls == ["decode_attention_packed"]
    kernels.cache_write_packed(two_pass, slots, k, v)
    expected = torch.empty_like(q)
    no_sinks = torch.empty(0)
    kernels.paged_attention_packed(
        expected,
        q,
        two_pass,
        tables,
        common.query_start_loc,
        context_lens,
        metadata.token_seq,
        torch.empty(0, dtype=torch.int64),
        0.125,
        window or 0,
        sink_logits.float() if sinks else no_sinks,
    )
    assert torch.equal(cache, two_pass)
    assert torch.equal(out, expected)


def test_decode_attention_packed_refuses_what_is_not_a_decode_step():
    from engine_cpu import native

    kernels = native.load()
    if kernels is None or not kernels.packed_kv_supported(16, 16):
        pytest.skip("packed layout unavailable on this CPU")
    cache = torch.zeros(2, 4, 1, 16 * 16, dtype=torch.bfloat16)
    q, k = torch.ones(2, 1, 16, dtype=torch.bfloat16), torch.ones(2, 1, 16, dtype=torch.bfloat16)
    tables, empty = torch.tensor([[0], [1]]), torch.empty(0)

    def call(slots, query_start_loc, token_seq):
        out = torch.empty_like(q)
        kernels.decode_attention_packed(
            out, q, k, k, cache, slots, tables, query_start_loc, torch.tensor([0, 0]), token_seq, 0.25, 0, empty
        )

    with pytest.raises(RuntimeError, match="sequence 0 has 2 new tokens"):
        call(torch.tensor([0, 1]), torch.tensor([0, 2, 2]), torch.tensor([0, 0]))
    with pytest.raises(RuntimeError, match="slot 64 out of range"):
        call(torch.tensor([0, 64]), torch.tensor([0, 1, 2]), torch.tensor([0, 1]))
    assert cache.count_nonzero() == 0  # nothing written by a refused call
    call(torch.tensor([0, 16]), torch.tensor([0, 1, 2]), torch.tensor([0, 1]))
    assert cache.count_nonzero() == 2 * 2 * 16
