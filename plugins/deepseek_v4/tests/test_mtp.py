"""The mtp proposer: drafts from the checkpoint's multi-token-prediction layer, verified by
the core, so greedy output is the target's own whatever the (here random) MTP weights."""

from __future__ import annotations

import json
import random

import pytest
import torch
from deepseek_helpers import make_llm
from safetensors.torch import load_file, save_file

from engine import SamplingParams
from engine.testing.kit import SpecProposerTests


def add_mtp_layer(path) -> None:
    """Give a tiny DeepSeek-V3 checkpoint one random MTP layer in DeepSeek's layout: a decoder
    layer (copied from layer 1, a MoE layer, then perturbed) under model.layers.3, plus
    embed_tokens, enorm, hnorm, eh_proj and shared_head."""
    config = json.loads((path / "config.json").read_text())
    hidden, index = config["hidden_size"], config["num_hidden_layers"]
    tensors = load_file(str(path / "model.safetensors"))
    generator = torch.Generator().manual_seed(7)

    def noise(shape, scale=0.05):
        return torch.randn(shape, generator=generator) * scale

    for name in [n for n in tensors if n.startswith("model.layers.1.")]:
        tensors[name.replace("model.layers.1.", f"model.layers.{index}.")] = tensors[name] + noise(
            tensors[name].shape, 0.02
        )
    prefix = f"model.layers.{index}."
    tensors[prefix + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[prefix + "enorm.weight"] = 1 + noise(hidden)
    tensors[prefix + "hnorm.weight"] = 1 + noise(hidden)
    tensors[prefix + "eh_proj.weight"] = noise((hidden, 2 * hidden), 0.1)
    tensors[prefix + "shared_head.norm.weight"] = 1 + noise(hidden)
    tensors[prefix + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, str(path / "model.safetensors"))
    config["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(config))


def add_v4_mtp_block(path) -> None:
    """Give a tiny DeepSeek-V4 checkpoint a random MTP block in the reference layout (mtp.0.*): a
    decoder block with layer 0's sliding attention and layer 1's score-routed experts (perturbed),
    enorm, hnorm, e_proj, h_proj, its own hc_head and norm."""
    config = json.loads((path / "config.json").read_text())
    hidden, n = config["hidden_size"], config["hc_mult"]
    tensors = load_file(str(path / "model.safetensors"))
    generator = torch.Generator().manual_seed(11)

    def noise(shape, scale=0.05):
        return torch.randn(shape, generator=generator) * scale

    parts = {0: ("attn.", "attn_norm.", "hc_attn_"), 1: ("ffn.", "ffn_norm.", "hc_ffn_")}
    for layer, starts in parts.items():
        source = f"model.layers.{layer}."
        for name in [m for m in tensors if m.startswith(source) and m[len(source) :].startswith(starts)]:
            tensors["mtp.0." + name[len(source) :]] = tensors[name] + noise(tensors[name].shape, 0.02)
    for name in ("enorm.weight", "hnorm.weight", "norm.weight"):
        tensors["mtp.0." + name] = 1 + noise(hidden)
    tensors["mtp.0.e_proj.weight"] = noise((hidden, hidden), 0.1)
    tensors["mtp.0.h_proj.weight"] = noise((hidden, hidden), 0.1)
    tensors["mtp.0.hc_head_fn"] = noise((n, n * hidden), 0.02)
    tensors["mtp.0.hc_head_base"] = noise(n)
    tensors["mtp.0.hc_head_scale"] = 1 + noise(1)
    save_file(tensors, str(path / "model.safetensors"))


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(("DeepseekV3ForCausalLM", {}), id="v3"),
        # V3.2: the MTP layer has an indexer too, selecting a few positions
        pytest.param(("DeepseekV32ForCausalLM", {"index_topk": 5, "index_n_heads": 8}), id="v3.2-sparse"),
        # V4: the block reads the target's hyper-connection streams before its head
        pytest.param(("DeepseekV4ForCausalLM", {"index_topk": 2}), id="v4"),
    ],
)
def checkpoint(request, tmp_path_factory):
    from engine.testing.checkpoints import make_tiny_checkpoint

    architecture, overrides = request.param
    path = tmp_path_factory.mktemp("deepseek_mtp")
    make_tiny_checkpoint(architecture, path, **overrides)
    (add_v4_mtp_block if architecture == "DeepseekV4ForCausalLM" else add_mtp_layer)(path)
    return path


def test_greedy_output_with_mtp_is_the_targets_and_acceptance_is_counted(checkpoint):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in (3, 11, 20, 37)]
    prompts.append([7, 8, 9] * 8)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in make_llm(checkpoint).generate(prompts, params, use_tqdm=False)]
    llm = make_llm(checkpoint, speculative_method="mtp", num_speculative_tokens=3)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    stats = llm.engine.spec.stats
    assert stats.proposed > 0 and 0 <= stats.accepted <= stats.proposed
    assert len(stats.acceptance_by_position()) >= 1


def test_a_checkpoint_without_mtp_layers_is_refused(tmp_path):
    from engine.testing.checkpoints import make_tiny_checkpoint

    make_tiny_checkpoint("DeepseekV3ForCausalLM", tmp_path)
    with pytest.raises(ValueError, match="no multi-token-prediction layer"):
        make_llm(tmp_path, speculative_method="mtp")


class TestMtpKit(SpecProposerTests):
    """The kit's target is a tiny Llama; mtp drafts from its own DeepSeek checkpoint, so the
    kit runs against a DeepSeek target here (the hidden states it hands over are the target's)."""

    plugin = "deepseek_v4"
    proposer_name = "mtp"
    also_load = ("cpu",)

    @pytest.fixture(scope="class")
    @classmethod
    def target(cls, tmp_path_factory):
        from engine.testing.checkpoints import make_tiny_checkpoint

        path = tmp_path_factory.mktemp("mtp_target")
        make_tiny_checkpoint("DeepseekV3ForCausalLM", path)
        add_mtp_layer(path)
        return path


class TestMtpV4Kit(SpecProposerTests):
    """The kit against a DeepSeek-V4 target, whose MTP block reads the streams before its head."""

    plugin = "deepseek_v4"
    proposer_name = "mtp"
    also_load = ("cpu",)

    @pytest.fixture(scope="class")
    @classmethod
    def target(cls, tmp_path_factory):
        from engine.testing.checkpoints import make_tiny_checkpoint

        path = tmp_path_factory.mktemp("mtp_v4_target")
        make_tiny_checkpoint("DeepseekV4ForCausalLM", path)
        add_v4_mtp_block(path)
        return path
