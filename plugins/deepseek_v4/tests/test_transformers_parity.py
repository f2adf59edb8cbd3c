"""DeepSeek-V3 against transformers on the same random weights (fp32), beyond the kit:
greedy generation of a batch, preemption and prefix caching, and checkpoint errors."""

from __future__ import annotations

import pytest
import torch
from deepseek_helpers import make_llm, prompts
from safetensors.torch import load_file, save_file

from engine import SamplingParams


def hf_greedy(hf_model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from engine.testing.checkpoints import make_tiny_checkpoint

    path = tmp_path_factory.mktemp("deepseek_v3")
    return path, make_tiny_checkpoint("DeepseekV3ForCausalLM", path)


def test_24_greedy_tokens_of_a_batch_match_transformers(checkpoint):
    path, hf_model = checkpoint
    batch = prompts(0)
    outputs = make_llm(path).generate(
        batch, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False
    )
    for prompt, output in zip(batch, outputs):
        assert output.outputs[0].token_ids == hf_greedy(hf_model, prompt, 24)


def test_preemption_and_prefix_caching_leave_outputs_unchanged(checkpoint):
    path, _ = checkpoint
    shared = prompts(1, lengths=(40,))[0]
    batch = [shared + [5], shared + [6, 7], *prompts(2, lengths=(9, 33, 50, 21))]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    expected = [
        o.outputs[0].token_ids
        for o in make_llm(path, enable_prefix_caching=False, max_num_seqs=1).generate(batch, params, use_tqdm=False)
    ]
    # 20 blocks of 16 latent entries (3 layers x 40 values x 4 bytes): six requests of up to 80 tokens
    llm = make_llm(path, kv_cache_memory=20 * 16 * 3 * 40 * 4 / 2**30, max_model_len=256)
    assert [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)] == expected
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.kv_manager.stats.hits > 0


def test_routed_experts_in_transformers_fused_layout_load_the_same(checkpoint, tmp_path):
    """A checkpoint with experts stacked as transformers holds them in memory
    (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]) gives the same logits."""
    import shutil

    path, _ = checkpoint
    shutil.copytree(path, tmp_path / "fused")
    tensors = load_file(str(path / "model.safetensors"))
    for layer in (1, 2):
        prefix = f"model.layers.{layer}.mlp.experts"
        gate_up = [
            torch.cat([tensors.pop(f"{prefix}.{e}.gate_proj.weight"), tensors.pop(f"{prefix}.{e}.up_proj.weight")])
            for e in range(8)
        ]
        down = [tensors.pop(f"{prefix}.{e}.down_proj.weight") for e in range(8)]
        tensors[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
        tensors[f"{prefix}.down_proj"] = torch.stack(down)
    save_file(tensors, str(tmp_path / "fused" / "model.safetensors"))
    batch = prompts(3)
    for a, b in zip(make_llm(path).prompt_logits(batch), make_llm(tmp_path / "fused").prompt_logits(batch)):
        assert torch.equal(a, b)


def test_an_unknown_checkpoint_tensor_is_an_error(checkpoint, tmp_path):
    import shutil

    path, _ = checkpoint
    shutil.copytree(path, tmp_path / "extra")
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.0.self_attn.surprise.weight"] = torch.zeros(2)
    save_file(tensors, str(tmp_path / "extra" / "model.safetensors"))
    with pytest.raises(KeyError, match="surprise"):
        make_llm(tmp_path / "extra")
