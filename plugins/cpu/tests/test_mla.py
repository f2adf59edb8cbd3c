"""cpu_mla at DeepSeek's sizes against a per-token, per-head loop over the unpaged entries;
its gather/scatter of cache entries; its validation of MLA specs."""

from __future__ import annotations

import pytest
import torch

from engine.interfaces.attention import MHA, MLA, AttentionSpec
from engine.plugins.manager import get_plugin_manager
from engine.selection import select_attention_backend
from engine.testing.kit.attention import make_common_metadata
from engine_cpu.mla import CpuMlaAttention
from engine_cpu.platform import CpuPlatform

LATENT, ROPE = 512, 64  # DeepSeek-V2/V3: kv_lora_rank, qk_rope_head_dim


def loop_mla(q, entries, context_len, scale, latent_size):
    """q: [n, H, D] at positions context_len..; entries: [L, 1, D] -> [n, H, latent_size] in float32."""
    n, num_heads, _ = q.shape
    out = torch.empty(n, num_heads, latent_size)
    for i in range(n):
        visible = entries[: context_len + i + 1, 0].float()  # [i + 1 + context, D]
        for h in range(num_heads):
            probs = (visible @ q[i, h].float() * scale).softmax(0)
            out[i, h] = probs @ visible[:, :latent_size]
    return out


def mla_spec(num_heads: int = 16) -> AttentionSpec:
    return AttentionSpec(MLA, num_heads, 1, LATENT + ROPE, 0.3 * (LATENT + ROPE) ** -0.5, latent_size=LATENT)


BATCHES = {
    # long and short prefill chunks after cached prefixes, a fresh prompt, and decodes (one of
    # them the sequence's first token)
    "mixed": ([30, 100, 0, 0, 17], [70, 1, 20, 1, 3]),
    "decode": ([100, 0, 37], [1, 1, 1]),
    "one fresh prompt": ([0], [45]),  # plain causal, no mask
    "one chunk after a prefix": ([33], [12]),
}


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_deepseek_sizes(batch, dtype, atol):
    """A step of ``batch`` after its cached prefixes (written with scatter_kv), in a stale cache."""
    gen = torch.Generator().manual_seed(7)
    spec, block_size = mla_spec(), 16
    context_lens, query_lens = BATCHES[batch]
    seq_lens = [c + n for c, n in zip(context_lens, query_lens)]
    counts = [-(-n // block_size) for n in seq_lens]
    perm = torch.randperm(sum(counts) + 2, generator=gen).tolist()
    tables = [perm[sum(counts[:b]) : sum(counts[: b + 1])] for b in range(len(counts))]
    backend = CpuMlaAttention(spec, block_size, dtype, torch.device("cpu"))
    cache = torch.randn(backend.kv_cache_shape(len(perm)), generator=gen).to(dtype)
    q = [torch.randn(n, spec.num_heads, spec.head_size, generator=gen).to(dtype) for n in seq_lens]
    entries = [torch.randn(n, 1, spec.head_size, generator=gen).to(dtype) for n in seq_lens]
    # prefix cache: the cached positions through scatter_kv, read back through gather_kv
    prefix = make_common_metadata([0] * len(seq_lens), context_lens, tables, block_size, torch.device("cpu"))
    cached = torch.cat([e[:c] for e, c in zip(entries, context_lens)])
    backend.scatter_kv(cache, prefix.slot_mapping, cached, None)
    k, v = backend.gather_kv(cache, prefix.slot_mapping)
    assert torch.equal(k, cached) and v.shape == (cached.shape[0], 0, spec.head_size)

    common = make_common_metadata(context_lens, query_lens, tables, block_size, torch.device("cpu"))
    new = [slice(c, c + n) for c, n in zip(context_lens, query_lens)]
    new_q, new_entries = (torch.cat([x[s] for x, s in zip(full, new)]) for full in (q, entries))
    with torch.inference_mode():
        out = backend.forward(new_q, new_entries, None, cache, backend.build_metadata(common))
    expected = torch.cat([loop_mla(x[s], e, s.start, spec.scale, LATENT) for x, e, s in zip(q, entries, new)])
    assert out.dtype == dtype and out.shape == (sum(query_lens), spec.num_heads, LATENT)
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=atol)
    assert torch.equal(backend.gather_kv(cache, common.slot_mapping)[0], new_entries)  # written at their slots


def test_scatter_refuses_values():
    spec = mla_spec(4)
    backend = CpuMlaAttention(spec, 4, torch.float32, torch.device("cpu"))
    cache = torch.zeros(backend.kv_cache_shape(2))
    slots = torch.tensor([1, 6])
    entries = torch.randn(2, 1, spec.head_size)
    with pytest.raises(ValueError, match="caches no values"):
        backend.scatter_kv(cache, slots, entries, entries)
    backend.scatter_kv(cache, slots, entries, entries[:, :0])
    assert torch.equal(cache[0, 1], entries[0, 0]) and torch.equal(cache[1, 2], entries[1, 0])


def test_validate_requires_a_latent_spec():
    ok = mla_spec(8)
    assert CpuMlaAttention.validate(ok, platform="cpu", dtype="bfloat16", block_size=16) == []
    for bad, reason in [
        (AttentionSpec(MLA, 8, 2, 576, 0.1, latent_size=512), "num_kv_heads must be 1"),
        (AttentionSpec(MLA, 8, 1, 576, 0.1), "latent_size must be set"),
        (AttentionSpec(MLA, 8, 1, 576, 0.1, latent_size=600), "latent_size must be set"),
    ]:
        reasons = CpuMlaAttention.validate(bad, platform="cpu", dtype="float32", block_size=16)
        assert any(reason in r for r in reasons), reasons
        with pytest.raises(ValueError, match=reason):
            CpuMlaAttention(bad, 16, torch.float32, torch.device("cpu"))
    mha = AttentionSpec(MHA, 8, 8, 64, 0.125)
    assert any(
        "attention kind 'mha'" in r
        for r in CpuMlaAttention.validate(mha, platform="cpu", dtype="float16", block_size=16)
    )


def test_cpu_platform_selects_cpu_mla():
    components = get_plugin_manager(["cpu"]).components()
    backend = select_attention_backend(
        components.attention_backends, CpuPlatform(), mla_spec(), dtype="bfloat16", block_size=16
    )
    assert backend is CpuMlaAttention
