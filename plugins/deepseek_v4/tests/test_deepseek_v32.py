"""DeepSeek-V3.2 (sparse MLA): against transformers where the indexer selects every position,
and against a plain dense-masked reference written here where it selects a few (fp32)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from deepseek_helpers import greedy, make_llm, prompts

SMALL_TOPK = 5


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """index_topk 64: more than any sequence here, so every causal position is selected."""
    from engine.testing.checkpoints import make_tiny_checkpoint

    path = tmp_path_factory.mktemp("deepseek_v32")
    return path, make_tiny_checkpoint("DeepseekV32ForCausalLM", path)


@pytest.fixture(scope="module")
def sparse(tmp_path_factory):
    """index_topk 5 with 8 indexer heads (few exact ties among ReLU'd scores)."""
    from engine.testing.checkpoints import make_tiny_checkpoint

    path = tmp_path_factory.mktemp("deepseek_v32_sparse")
    return path, make_tiny_checkpoint("DeepseekV32ForCausalLM", path, index_topk=SMALL_TOPK, index_n_heads=8, seed=3)


def test_24_greedy_tokens_of_a_batch_match_transformers(dense):
    path, hf_model = dense
    batch = prompts(0)
    for prompt, tokens in zip(batch, greedy(make_llm(path), batch, 24)):
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False)
        assert tokens == out[0, len(prompt) :].tolist()


def rope_cos_sin(positions: torch.Tensor, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = positions[:, None].float() * inv_freq[None, :]  # [n, dim / 2]
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rope on x [n, heads, dim]: pairs (x[2i], x[2i+1]) when interleaved (output evens then odds,
    as DeepSeek's MLA lays them out), else (x[i], x[i + dim/2])."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
    else:
        a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def sparse_attention(attn, h: torch.Tensor, config, topk: int) -> torch.Tensor:
    """One layer's attention over one whole sequence h [n, hidden], computed the plain way: keys
    and values up-projected per head, every index score, a [n, n] mask of the causal top-k."""
    n, heads = h.shape[0], config.num_attention_heads
    nope, rope, v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
    cos, sin = rope_cos_sin(torch.arange(n), rope, config.rope_parameters["rope_theta"])
    q_latent = attn.q_a_layernorm(h @ attn.q_a_proj.weight.T)
    q = (q_latent @ attn.q_b_proj.weight.T).view(n, heads, nope + rope)
    compressed = h @ attn.kv_a_proj_with_mqa.weight.T
    c, k_rope = compressed[:, : config.kv_lora_rank], compressed[:, config.kv_lora_rank :]
    kv = (attn.kv_a_layernorm(c) @ attn.kv_b_proj.weight.T).view(n, heads, nope + v_dim)
    q = torch.cat([q[..., :nope], rotate(q[..., nope:], cos, sin, True)], dim=-1)
    k_rope = rotate(k_rope.view(n, 1, rope), cos, sin, True).expand(n, heads, rope)
    k = torch.cat([kv[..., :nope], k_rope], dim=-1)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    # the indexer: its queries, keys (LayerNorm, rope on the first dims, halves not interleaved)
    index = attn.indexer
    index_heads, index_dim = config.index_n_heads, config.index_head_dim
    iq = (q_latent @ index.wq_b.weight.T).view(n, index_heads, index_dim)
    ik = F.layer_norm(h @ index.wk.weight.T, (index_dim,), index.k_norm.weight, index.k_norm.bias, 1e-6).view(n, 1, -1)
    iq = torch.cat([rotate(iq[..., :rope], cos, sin, False), iq[..., rope:]], dim=-1)
    ik = torch.cat([rotate(ik[..., :rope], cos, sin, False), ik[..., rope:]], dim=-1)[:, 0]
    per_head = torch.einsum("ihd,jd->ihj", iq, ik).relu() / math.sqrt(index_dim)  # [n, heads, n]
    weights = (h @ index.weights_proj.weight.T) / math.sqrt(index_heads)  # [n, heads]
    index_scores = torch.einsum("ihj,ih->ij", per_head, weights).masked_fill(~causal, float("-inf"))
    chosen = index_scores.topk(min(topk, n), dim=-1).indices
    selected = torch.zeros(n, n, dtype=torch.bool).scatter_(1, chosen, True) & causal
    scores = torch.einsum("ihd,jhd->hij", q, k) / math.sqrt(nope + rope)
    probs = scores.masked_fill(~selected, float("-inf")).softmax(dim=-1)
    out = torch.einsum("hij,jhd->ihd", probs, kv[..., nope:]).reshape(n, heads * v_dim)
    return out @ attn.o_proj.weight.T


def reference_logits(hf_model, tokens: list[int], topk: int = SMALL_TOPK) -> torch.Tensor:
    """[n, vocab]: transformers' embedding, norms and MLPs around :func:`sparse_attention`."""
    model, config = hf_model.model, hf_model.config
    with torch.no_grad():
        x = model.embed_tokens(torch.tensor(tokens))
        for layer in model.layers:
            x = x + sparse_attention(layer.self_attn, layer.input_layernorm(x), config, topk)
            x = x + layer.mlp(layer.post_attention_layernorm(x)[None])[0]
        return hf_model.lm_head(model.norm(x))


def test_a_small_index_topk_matches_a_dense_masked_reference(sparse):
    """With index_topk 5 the selection matters (the reference differs from dense attention);
    prompt logits match the plain reference within 1e-4 (as transformers' forward of each
    prompt alone does) and 24 greedy tokens of the batch equal the reference's own."""
    path, hf_model = sparse
    batch = prompts(4)
    llm = make_llm(path)
    for prompt, logits in zip(batch, llm.prompt_logits(batch)):
        reference = reference_logits(hf_model, prompt)
        atol = 1e-4 * max(1.0, reference.abs().max().item())
        with torch.no_grad():  # the reference is transformers' for one unpadded sequence
            assert (hf_model(torch.tensor([prompt])).logits[0] - reference).abs().max().item() <= atol
        assert (logits - reference).abs().max().item() <= atol
    everything = reference_logits(hf_model, batch[-1], topk=len(batch[-1]))
    assert (everything - reference).abs().max().item() > 1e-2, "index_topk 5 selected as much as dense attention"
    for prompt, tokens in zip(batch, greedy(llm, batch, 24)):
        sequence = list(prompt)
        for _ in range(24):
            sequence.append(int(reference_logits(hf_model, sequence)[-1].argmax()))
        assert tokens == sequence[len(prompt) :]


def test_preemption_and_prefix_caching_leave_outputs_unchanged(sparse):
    """Shared prefixes reuse both KV-cache groups' blocks (latent entries and indexer keys), and
    requests preempted by recompute rebuild both; greedy outputs stay those of one request at a time."""
    path, _ = sparse
    shared = prompts(1, lengths=(40,))[0]
    batch = [shared + [5], shared + [6, 7], *prompts(2, lengths=(9, 33, 50, 21))]
    expected = greedy(make_llm(path, enable_prefix_caching=False, max_num_seqs=1), batch, 30)
    # 20 blocks of 16 tokens, each token 3 layers x (40 latent + 16 indexer values) x 4 bytes
    llm = make_llm(path, kv_cache_memory=20 * 16 * 3 * 56 * 4 / 2**30, max_model_len=256)
    assert greedy(llm, batch, 30) == expected
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.kv_manager.stats.hits > 0


def test_a_requested_backend_serves_the_kinds_it_declares(sparse):
    """--attention-backend cpu_mla serves the sparse-MLA layers and leaves the indexer's keys to
    the platform's choice; a backend serving none of the model's kinds is refused with reasons."""
    from engine.selection import SelectionError

    path, _ = sparse
    backends = {g.spec.kind: g.backend.name for g in make_llm(path, attention_backend="cpu_mla").engine.kv_cache.groups}
    assert backends == {"sparse_mla": "cpu_mla", "indexer": "cpu_indexer"}
    with pytest.raises(SelectionError, match="cpu_paged.*attention kind 'sparse_mla' not supported"):
        make_llm(path, attention_backend="cpu_paged")
