"""DeepSeek-V4 against transformers on the same random weights (fp32), beyond the kit: greedy
generation of a batch, a small index_topk, preemption and prefix caching over the token-state
caches, both checkpoint naming schemes, and checkpoint errors."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepseek_helpers import greedy, make_llm, prompts


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
        assert tokens == out[0, len(prompt):].tolist()


def test_a_small_index_topk_matches_transformers_recomputing_each_sequence(sparse, tmp_path):
    """With index_topk 2 the indexer's choice matters (transformers' logits differ from those of
    the same weights keeping every entry). The reference is transformers' uncached forward of each
    sequence alone, which masks densely; prompt logits match within 1e-4 and 24 greedy tokens of
    the batch equal the reference's, recomputed for every token."""
    from engine.testing.checkpoints import make_tiny_checkpoint

    path, hf_model = sparse
    every_entry = make_tiny_checkpoint("DeepseekV4ForCausalLM", tmp_path, seed=3, index_topk=64, index_n_heads=8)
    batch = prompts(4)
    assert (hf_logits(hf_model, batch[-1]) - hf_logits(every_entry, batch[-1])).abs().max() > 1e-2
    llm = make_llm(path)
    for prompt, logits in zip(batch, llm.prompt_logits(batch)):
        reference = hf_logits(hf_model, prompt)
        assert (logits - reference).abs().max().item() <= 1e-4 * max(1.0, reference.abs().max().item())
    for prompt, tokens in zip(batch, greedy(llm, batch, 24)):
        sequence = list(prompt)
        for _ in range(24):
            sequence.append(int(hf_logits(hf_model, sequence)[-1].argmax()))
        assert tokens == sequence[len(prompt):]


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
