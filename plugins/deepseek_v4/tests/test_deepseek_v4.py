"""DeepSeek-V4 against transformers on the same random weights (fp32), beyond the kit: greedy
generation of a batch, a small index_topk against a dense-masked reference written here,
preemption and prefix caching over the token-state caches, both checkpoint naming schemes, and
checkpoint errors."""

from __future__ import annotations

import shutil

import pytest
import torch
from deepseek_helpers import greedy, make_llm, prompts
from safetensors.torch import load_file, save_file


def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    """transformers' forward of one unpadded sequence, no cache carried over."""
    with torch.no_grad():
        return hf_model(torch.tensor([tokens]), use_cache=False).logits[0]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """index_topk 64: more than the compressed entries of any sequence here, so the indexer keeps
    every finished entry."""
    from engine.testing.checkpoints import make_tiny_checkpoint

    path = tmp_path_factory.mktemp("deepseek_v4")
    return path, make_tiny_checkpoint("DeepseekV4ForCausalLM", path)


@pytest.fixture(scope="module")
def sparse(tmp_path_factory):
    """The same weights as a seed-3 checkpoint with index_topk 64, but index_topk 2."""
    from engine.testing.checkpoints import make_tiny_checkpoint

    path = tmp_path_factory.mktemp("deepseek_v4_sparse")
    return path, make_tiny_checkpoint("DeepseekV4ForCausalLM", path, seed=3, index_topk=2, index_n_heads=8)


def test_24_greedy_tokens_of_a_batch_match_transformers(checkpoint):
    path, hf_model = checkpoint
    batch = prompts(0)
    for prompt, tokens in zip(batch, greedy(make_llm(path), batch, 24)):
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False)
        assert tokens == out[0, len(prompt) :].tolist()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rope on the trailing 2 · cos.shape[-1] dims of x [n, ..., D], pairs (x0, x1), ... in place."""
    dim = 2 * cos.shape[-1]
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    a, b = x[..., -dim:][..., 0::2], x[..., -dim:][..., 1::2]
    return torch.cat([x[..., :-dim], torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)], -1)


def pool(kv: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, ratio: int, size: int, overlap: bool, norm):
    """Every complete window of ``ratio`` tokens of one sequence as one entry [windows, size]: a
    softmax over the window's slots (with the previous window's first series, when overlapping)."""
    entries = []
    for w in range(kv.shape[0] // ratio):
        now = slice(w * ratio, (w + 1) * ratio)
        if not overlap:
            slots, gates = kv[now], gate[now] + bias
        else:
            before = slice((w - 1) * ratio, w * ratio)
            previous = (
                (kv[before, :size], gate[before, :size] + bias[:, :size])
                if w
                else (torch.zeros(ratio, size), torch.full((ratio, size), float("-inf")))
            )
            slots = torch.cat([previous[0], kv[now, size:]])
            gates = torch.cat([previous[1], gate[now, size:] + bias[:, size:]])
        entries.append((slots * gates.softmax(dim=0)).sum(dim=0))
    return norm(torch.stack(entries)) if entries else torch.zeros(0, size)


def dense_attention(attn, x: torch.Tensor, config, rotary) -> torch.Tensor:
    """One V4 attention over one whole sequence x [n, hidden], masked densely: the window, the
    finished compressed entries (those the indexer picks, for compressed sparse layers), the sinks."""
    n, heads, head_dim = x.shape[0], config.num_attention_heads, config.head_dim
    positions = torch.arange(n)
    angles = {kind: [t[0] for t in rotary(x[None], positions[None], layer_type=kind)] for kind in ("main", "compress")}
    cos, sin = angles["main" if attn.layer_type == "sliding_attention" else "compress"]
    q_latent = attn.q_a_norm(attn.q_a_proj(x))
    q = attn.q_b_proj(q_latent).view(n, heads, head_dim)
    q = rotate(q * torch.rsqrt(q.square().mean(-1, keepdim=True) + config.rms_norm_eps), cos, sin)
    kv = rotate(attn.kv_norm(attn.kv_proj(x)), cos, sin)
    keys = [kv]
    masks = [
        (positions[None, :] <= positions[:, None]) & (positions[:, None] - positions[None, :] < config.sliding_window)
    ]
    if attn.compressor is not None:
        compressor, ratio = attn.compressor, config.compress_rates[attn.layer_type]
        overlap = attn.layer_type == "compressed_sparse_attention"
        entries = pool(
            compressor.kv_proj(x),
            compressor.gate_proj(x),
            compressor.position_bias,
            ratio,
            head_dim,
            overlap,
            compressor.kv_norm,
        )
        window_starts = torch.arange(entries.shape[0]) * ratio
        c_cos, c_sin = [t[0] for t in rotary(x[None], window_starts[None], layer_type="compress")]
        entries = rotate(entries, c_cos, c_sin)
        visible = window_starts[None, :] + ratio - 1 <= positions[:, None]  # [n, entries]
        if overlap and entries.shape[0]:  # the lightning indexer
            indexer, index_dim = compressor.indexer, config.index_head_dim
            index_keys = rotate(
                pool(
                    indexer.kv_proj(x),
                    indexer.gate_proj(x),
                    indexer.position_bias,
                    ratio,
                    index_dim,
                    True,
                    indexer.kv_norm,
                ),
                c_cos,
                c_sin,
            )
            index_q = rotate(indexer.q_b_proj(q_latent).view(n, -1, index_dim), *angles["compress"])
            per_head = torch.einsum("ihd,wd->ihw", index_q, index_keys).relu() * index_dim**-0.5
            weights = indexer.scorer.weights_proj(x) * config.index_n_heads**-0.5
            scores = torch.einsum("ihw,ih->iw", per_head, weights).masked_fill(~visible, float("-inf"))
            best, chosen = scores.topk(min(config.index_topk, entries.shape[0]), dim=-1)
            picked = torch.zeros_like(visible).scatter_(1, chosen, best > float("-inf"))
            visible = visible & picked
        keys.append(entries)
        masks.append(visible)
    keys, mask = torch.cat(keys), torch.cat(masks, dim=1)
    scores = torch.einsum("ihd,jd->hij", q, keys) * head_dim**-0.5
    scores = scores.masked_fill(~mask[None], float("-inf"))
    sinks = attn.sinks[:, None, None].expand(-1, n, 1)
    probs = torch.cat([scores, sinks], dim=-1).softmax(dim=-1)[..., :-1]  # the sink takes weight, gives nothing
    out = rotate(torch.einsum("hij,jd->ihd", probs, keys), cos, -sin)  # [n, heads, head_dim]
    groups = config.o_groups
    grouped = torch.einsum(
        "tgi,goi->tgo", out.reshape(n, groups, -1), attn.o_a_proj.weight.view(groups, config.o_lora_rank, -1)
    )
    return attn.o_b_proj(grouped.flatten(1))


def dense_reference_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    """[n, vocab]: transformers' embedding, hyper-connections, experts and head around
    :func:`dense_attention`."""
    model, config = hf_model.model, hf_model.config
    ids = torch.tensor([tokens])
    with torch.no_grad():
        streams = model.embed_tokens(ids)[:, :, None].expand(-1, -1, config.hc_mult, -1).contiguous()  # [1, n, hc, D]
        for layer in model.layers:
            post, comb, collapsed = layer.attn_hc(streams)
            out = dense_attention(layer.self_attn, layer.input_layernorm(collapsed)[0], config, model.rotary_emb)
            streams = post.unsqueeze(-1) * out[None, :, None] + torch.matmul(comb.transpose(-1, -2), streams)
            post, comb, collapsed = layer.ffn_hc(streams)
            out = layer.mlp(layer.post_attention_layernorm(collapsed), input_ids=ids)
            streams = post.unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), streams)
        return hf_model.lm_head(model.norm(model.hc_head(streams)))[0]


def test_a_small_index_topk_matches_a_dense_masked_reference(sparse, tmp_path):
    """With index_topk 2 the indexer's choice matters (the same weights keeping every entry give
    other logits). The reference, written here, masks densely over each whole sequence (and agrees
    with transformers' uncached forward of each prompt alone); prompt logits match it within 1e-4
    and 24 greedy tokens of the batch equal its own, recomputed for every token."""
    from engine.testing.checkpoints import make_tiny_checkpoint

    path, hf_model = sparse
    every_entry = make_tiny_checkpoint("DeepseekV4ForCausalLM", tmp_path, seed=3, index_topk=64, index_n_heads=8)
    batch = prompts(4)
    assert (hf_logits(hf_model, batch[-1]) - hf_logits(every_entry, batch[-1])).abs().max() > 1e-2
    llm = make_llm(path)
    for prompt, logits in zip(batch, llm.prompt_logits(batch)):
        reference = dense_reference_logits(hf_model, prompt)
        atol = 1e-4 * max(1.0, reference.abs().max().item())
        assert (hf_logits(hf_model, prompt) - reference).abs().max().item() <= atol
        assert (logits - reference).abs().max().item() <= atol
    for prompt, tokens in zip(batch, greedy(llm, batch, 24)):
        sequence = list(prompt)
        for _ in range(24):
            sequence.append(int(dense_reference_logits(hf_model, sequence)[-1].argmax()))
        assert tokens == sequence[len(prompt) :]


def test_preemption_and_prefix_caching_leave_outputs_unchanged(sparse):
    """Shared prefixes reuse every cache layer's blocks (window keys, compressed entries,
    compressor and indexer states), and preempted requests rebuild them; greedy outputs stay
    those of one request at a time without prefix caching."""
    path, _ = sparse
    shared = prompts(1, lengths=(40,))[0]
    batch = [shared + [5], shared + [6, 7], *prompts(2, lengths=(9, 33, 50, 21))]
    expected = greedy(make_llm(path, enable_prefix_caching=False, max_num_seqs=1), batch, 30)
    llm = make_llm(path)
    specs = llm.engine.model.kv_cache_specs()
    bytes_per_token = sum(spec.kv_bytes_per_token(4) for spec in specs)
    # 20 blocks of 16 tokens: six requests of up to 80 tokens must take turns
    llm = make_llm(path, kv_cache_memory=20 * 16 * bytes_per_token / 2**30, max_model_len=256)
    assert greedy(llm, batch, 30) == expected
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.kv_manager.stats.hits > 0


def test_reference_and_transformers_tensor_names_load_the_same(checkpoint, tmp_path):
    """transformers saves the reference checkpoints' names under "model." (``model.layers.0.attn.
    wq_a.weight``, ``head.weight``); the reference files have no prefix (``layers.0.attn.wq_a.
    weight``, ``embed.weight``, ``hc_head_fn``); transformers' own module names (``model.layers.
    0.self_attn.q_a_proj.weight``, stacked experts) load too. All give the same logits."""
    path, hf_model = checkpoint
    saved = load_file(str(path / "model.safetensors"))
    assert "model.layers.1.attn.wq_a.weight" in saved and "head.weight" in saved

    def reference_name(name: str) -> str:
        name = name.removeprefix("model.")
        name = {"embed_tokens.weight": "embed.weight"}.get(name, name)
        return name.replace("hc_head.hc_", "hc_head_")

    variants = {
        "reference": {reference_name(n): t for n, t in saved.items()},
        "transformers": {n: t.detach().clone() for n, t in hf_model.state_dict().items()},
    }
    assert "layers.1.attn.wq_a.weight" in variants["reference"] and "embed.weight" in variants["reference"]
    assert "model.layers.1.self_attn.compressor.indexer.q_b_proj.weight" in variants["transformers"]
    batch = prompts(3)
    expected = make_llm(path).prompt_logits(batch)
    for label, tensors in variants.items():
        shutil.copytree(path, tmp_path / label)
        save_file(tensors, str(tmp_path / label / "model.safetensors"))
        for a, b in zip(expected, make_llm(tmp_path / label).prompt_logits(batch)):
            assert torch.equal(a, b), label


def test_an_unknown_checkpoint_tensor_is_an_error(checkpoint, tmp_path):
    path, _ = checkpoint
    shutil.copytree(path, tmp_path / "extra")
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.0.attn.surprise.weight"] = torch.zeros(2)
    save_file(tensors, str(tmp_path / "extra" / "model.safetensors"))
    with pytest.raises(KeyError, match="surprise"):
        make_llm(tmp_path / "extra")
