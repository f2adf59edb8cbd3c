"""The mtp proposer on Qwen3.5, Qwen3.5-MoE and Qwen3-Next: drafts from the checkpoint's
multi-token-prediction block (``mtp.*``) against a reference of the block built from
transformers' own decoder layer and run without a cache; greedy outputs with it are the
target's own (the DeltaNet states rolled back past rejected drafts), through preemption; and
the kit."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.testing.kit import SpecProposerTests

PLUGINS = ["cpu", "qwen"]
VOCAB = 320  # the tiny Qwen3.5's
PARAMS = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
PROMPTS = [[17, 45, 9, 101, 33] * 3, [200, 7, 7, 64, 5, 90, 12], [3, 4, 5, 6] * 4, [250, 31, 8]]


def add_mtp_block(path, seed: int = 5) -> None:
    """Give a tiny Qwen3.5 checkpoint a random MTP block in the published layout: a decoder
    layer under ``mtp.layers.0`` (the full-attention layer's attention and norms and layer 0's
    MLP, whose kind the block's first layer has, both perturbed), ``fc`` [hidden, 2 · hidden]
    and the zero-centred norms ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden`` and ``norm``;
    ``mtp_num_hidden_layers: 1`` in config.json."""
    config = json.loads((path / "config.json").read_text())
    text = config.get("text_config", config)  # a multimodal checkpoint's text model: model.language_model.*
    base = "model.language_model." if "text_config" in config else "model."
    hidden = text["hidden_size"]
    attention = f"{base}layers.{text['layer_types'].index('full_attention')}."
    tensors = load_file(str(path / "model.safetensors"))
    generator = torch.Generator().manual_seed(seed)

    def noise(shape, scale=0.1):
        return torch.randn(shape, generator=generator) * scale

    copied = [(n, attention) for n in tensors if n.startswith(attention) and ".mlp." not in n]
    copied += [(n, f"{base}layers.0.") for n in tensors if n.startswith(f"{base}layers.0.mlp.")]
    for name, source in copied:
        tensors["mtp.layers.0." + name[len(source) :]] = tensors[name] + noise(tensors[name].shape, 0.05)
    tensors["mtp.fc.weight"] = noise((hidden, 2 * hidden), 0.15)
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{name}.weight"] = noise(hidden)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    text["mtp_num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(config))


ARCHITECTURES = ["Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM"]


@pytest.fixture(scope="module", params=ARCHITECTURES)
def checkpoint(request, tmp_path_factory):
    """(path, transformers' model) of a tiny model of each family with an MTP block."""
    from engine.testing.checkpoints import make_tiny_checkpoint

    path = tmp_path_factory.mktemp("qwen_mtp")
    hf_model = make_tiny_checkpoint(request.param, path)
    add_mtp_block(path)
    return path, hf_model


# the reference: transformers' decoder layer, plain torch for the rest, no cache


class ReferenceBlock:
    """The MTP block from the checkpoint's tensors: ``x = fc([n_e(embed(token)); n_h(hidden)])``,
    the family's transformers decoder layer (full attention) over all rows at once (causal), then
    ``norm``; logits through the target's LM head. Norms are zero-centred: ``x̂ · (1 + w)``."""

    def __init__(self, path, hf_model) -> None:
        import copy

        modeling = __import__(type(hf_model).__module__, fromlist=["_"])
        family = type(hf_model).__name__.removesuffix("ForCausalLM")
        tensors = load_file(str(path / "model.safetensors"))
        # the block's layer is layer 0 of a model whose layer 0 is full attention
        self.config = config = copy.deepcopy(hf_model.config)
        config._attn_implementation = "eager"
        config.layer_types = ["full_attention", *config.layer_types[1:]]
        self.layer = getattr(modeling, f"{family}DecoderLayer")(config, 0).eval()
        prefix = "mtp.layers.0."
        self.layer.load_state_dict(
            fused_experts({n[len(prefix) :]: t for n, t in tensors.items() if n.startswith(prefix)})
        )
        self.rotary = next(m for m in hf_model.modules() if type(m).__name__.endswith("RotaryEmbedding"))
        self.embed = tensors["model.embed_tokens.weight"]
        self.head = tensors.get("lm_head.weight", self.embed)  # tie_word_embeddings: the embedding
        self.fc = tensors["mtp.fc.weight"]
        self.norms = {n: tensors[f"mtp.{n}.weight"] for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}

    def norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.config.rms_norm_eps) * (1 + self.norms[name])

    @torch.no_grad()
    def __call__(self, rows: list[tuple[int, torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """rows: (token, hidden state of the position before it, position) -> outputs [R, hidden], logits [R, vocab]."""
        tokens = torch.tensor([t for t, _, _ in rows])
        hidden = torch.stack([h for _, h, _ in rows])
        positions = torch.tensor([[p for _, _, p in rows]])
        x = torch.cat(
            [self.norm("pre_fc_norm_embedding", self.embed[tokens]), self.norm("pre_fc_norm_hidden", hidden)], -1
        )
        x = (x @ self.fc.T)[None]
        mask = torch.full((len(rows), len(rows)), float("-inf")).triu(1)[None, None]
        y = self.layer(x, position_embeddings=self.rotary(x, positions), attention_mask=mask)[0]
        out = self.norm("norm", y)
        return out, out @ self.head.T

    def drafts(self, rows: list, num_tokens: int) -> tuple[list[int], torch.Tensor, list]:
        """The argmax chain from ``rows`` (each draft's row reads the previous row's output), each
        draft's logits [num_tokens, vocab], and the rows it ran."""
        rows, drafts, logits = list(rows), [], []
        for _ in range(num_tokens):
            out, step = self(rows)
            logits.append(step[-1])
            drafts.append(int(step[-1].argmax()))
            rows.append((drafts[-1], out[-1], rows[-1][2] + 1))
        return drafts, torch.stack(logits), rows[:-1]


def fused_experts(tensors: dict) -> dict:
    """Per-expert checkpoint tensors (``mlp.experts.{e}.{gate,up,down}_proj.weight``) as
    transformers' modules hold them: ``experts.gate_up_proj`` [E, 2 · I, H] (gate rows first)
    and ``experts.down_proj`` [E, H, I]."""
    count = len({n.split(".")[2] for n in tensors if n.startswith("mlp.experts.")})
    if not count:
        return tensors
    out = {n: t for n, t in tensors.items() if not n.startswith("mlp.experts.")}
    expert = [{p: tensors[f"mlp.experts.{e}.{p}_proj.weight"] for p in ("gate", "up", "down")} for e in range(count)]
    out["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([w["gate"], w["up"]]) for w in expert])
    out["mlp.experts.down_proj"] = torch.stack([w["down"] for w in expert])
    return out


def make_proposer(path):
    from engine.interfaces.spec_proposer import ProposerInit
    from engine.plugins.manager import get_plugin_manager
    from engine.selection import select_platform

    components = get_plugin_manager(PLUGINS).components()
    init = ProposerInit(
        config={},
        target_model_path=path,
        vocab_size=VOCAB,
        dtype=torch.float32,
        device=torch.device("cpu"),
        components=components,
        platform=select_platform(components.platforms, "cpu"),
    )
    return components.spec_proposers.get("mtp")(init)


def test_drafts_are_the_reference_blocks_argmax_chain_through_acceptance_and_rollback(checkpoint):
    """Three rounds for one request: fresh; after its first draft was accepted (the block's
    entries for the kept tokens stay, read by the new ones); after tokens that left a gap (the
    block starts afresh at the newest token)."""
    from engine.interfaces.spec_proposer import FINAL_HIDDEN_STATES, DraftRequest

    path, hf_model = checkpoint
    reference, proposer = ReferenceBlock(path, hf_model), make_proposer(path)
    assert proposer.hidden_state_layers == (FINAL_HIDDEN_STATES,)
    seen = []  # the logits of each draft the proposer computes
    compute_logits = proposer.layer.compute_logits

    def recording(out):
        seen.append(compute_logits(out))
        return seen[-1]

    proposer.layer.compute_logits = recording

    def target_hidden(tokens):  # the target's final hidden states (after its norm), transformers'
        with torch.no_grad():
            return hf_model.model(input_ids=torch.tensor([tokens])).last_hidden_state[0]

    def check(tokens, rows_before):
        """The proposer's drafts for ``tokens`` are the reference's from ``rows_before`` and a
        row for the newest token; returns the reference's rows."""
        hidden = target_hidden(tokens)[len(tokens) - 2]  # the row that produced the newest token
        seen.clear()
        got = proposer.propose([DraftRequest("r", tuple(tokens))], 3, {FINAL_HIDDEN_STATES: hidden[None]})
        rows = [*rows_before, (tokens[-1], hidden, len(tokens) - 1)]
        expected, logits, ran = reference.drafts(rows, 3)
        assert got.token_ids[0] == expected
        torch.testing.assert_close(torch.cat(seen), logits, atol=1e-4, rtol=1e-4)
        return expected, ran

    first = [11, 250, 37, 4, 98, 160, 23, 71]
    drafts, ran = check(first, [])
    # the first draft accepted, then the target's own token: the block's first two entries stay
    accepted = [*first, drafts[0], 5]
    check(accepted, ran[:2])
    # the draft at position 8 rejected: nothing after position 7 stays, so the block starts afresh
    check([*first, (drafts[0] + 1) % VOCAB, 5, 9], [])


# the engine: greedy outputs with the proposer are the target's


@pytest.fixture
def flat_step_costs(monkeypatch):
    """Every step costs the same to the adaptive budget, so drafts are always verified."""
    from engine.spec_decode.budget import StepCostTable

    monkeypatch.setattr(StepCostTable, "estimate", lambda self, num_tokens: 1.0)


def generate(path, **kwargs) -> tuple[list[list[int]], LLM]:
    settings = {"plugins": PLUGINS, "dtype": "float32", "kv_cache_memory": 0.02, "progress": False, **kwargs}
    llm = LLM(str(path), **settings)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)], llm


def test_greedy_output_with_mtp_is_the_targets(checkpoint, flat_step_costs):
    path, _ = checkpoint
    expected, _ = generate(path)
    got, llm = generate(path, speculative_method="mtp", num_speculative_tokens=3)
    assert got == expected
    stats = llm.engine.spec.stats
    assert stats.proposed > 0 and stats.accepted < stats.proposed  # drafts were verified, some rejected
    assert llm.engine.shard.runner.rewinds > 0  # the DeltaNet states were put back past rejected drafts


def test_greedy_output_with_mtp_through_preemption_is_the_targets(checkpoint, flat_step_costs):
    """A cache of a few blocks: requests take turns, preempted ones start afresh."""
    path, _ = checkpoint
    expected, probe = generate(path, max_num_seqs=1)
    specs = probe.engine.model.kv_cache_specs()
    states = 4 * sum(spec.state_numel() * 4 for spec in specs if spec.is_recurrent)
    blocks = 5 * 16 * sum(spec.kv_bytes_per_token(4) for spec in specs)
    got, llm = generate(
        path,
        kv_cache_memory=(states + blocks) / 2**30,
        max_model_len=64,
        max_num_seqs=4,
        speculative_method="mtp",
        num_speculative_tokens=3,
    )
    assert got == expected
    assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("architecture", ["Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"])
def test_greedy_output_with_mtp_is_the_targets_on_a_multimodal_checkpoint(architecture, tmp_path, flat_step_costs):
    """The published layout: the config under text_config, the embedding under
    model.language_model., the block's tensors under mtp."""
    from engine.testing.checkpoints import make_tiny_checkpoint

    make_tiny_checkpoint(architecture, tmp_path)
    add_mtp_block(tmp_path)
    expected, _ = generate(tmp_path)
    got, llm = generate(tmp_path, speculative_method="mtp", num_speculative_tokens=3)
    assert got == expected
    assert llm.engine.spec.stats.proposed > 0


def test_drafts_with_tied_embeddings_read_the_embedding_as_head(tmp_path):
    """A checkpoint without lm_head.weight (tie_word_embeddings): the block's head is the
    target's embedding."""
    from engine.interfaces.spec_proposer import FINAL_HIDDEN_STATES, DraftRequest
    from engine.testing.checkpoints import make_tiny_checkpoint

    hf_model = make_tiny_checkpoint("Qwen3_5ForCausalLM", tmp_path, tie_word_embeddings=True)
    add_mtp_block(tmp_path)
    assert "lm_head.weight" not in load_file(str(tmp_path / "model.safetensors"))
    proposer = make_proposer(tmp_path)
    tokens = [11, 250, 37, 4, 98]
    with torch.no_grad():
        hidden = hf_model.model(input_ids=torch.tensor([tokens])).last_hidden_state[0, -2]
    got = proposer.propose([DraftRequest("r", tuple(tokens))], 3, {FINAL_HIDDEN_STATES: hidden[None]})
    expected, _, _ = ReferenceBlock(tmp_path, hf_model).drafts([(tokens[-1], hidden, len(tokens) - 1)], 3)
    assert got.token_ids[0] == expected


def test_a_checkpoint_without_an_mtp_block_is_refused(tmp_path):
    from engine.testing.checkpoints import make_tiny_checkpoint

    make_tiny_checkpoint("Qwen3_5ForCausalLM", tmp_path)
    with pytest.raises(
        ValueError, match=r"no multi-token-prediction layer \(mtp_num_hidden_layers is None; tensors mtp"
    ):
        LLM(str(tmp_path), plugins=PLUGINS, dtype="float32", progress=False, speculative_method="mtp")


def test_a_family_without_an_mtp_block_is_refused_naming_those_with_one(tmp_path):
    from engine.testing.checkpoints import make_tiny_checkpoint

    make_tiny_checkpoint("LlamaForCausalLM", tmp_path)
    with pytest.raises(ValueError, match=r"no model plugin registers one for 'LlamaForCausalLM'.*Qwen3_5ForCausalLM"):
        LLM(str(tmp_path), plugins=[*PLUGINS, "llama"], dtype="float32", progress=False, speculative_method="mtp")


class TestQwenMtpKit(SpecProposerTests):
    """The kit against a Qwen3.5 target with an MTP block (the hidden states it hands over are
    the target's)."""

    plugin = "qwen"
    proposer_name = "mtp"
    also_load = ("cpu",)

    @pytest.fixture(scope="class")
    @classmethod
    def target(cls, tmp_path_factory):
        from engine.testing.checkpoints import make_tiny_checkpoint

        path = tmp_path_factory.mktemp("qwen_mtp_target")
        make_tiny_checkpoint("Qwen3_5ForCausalLM", path)
        add_mtp_block(path)
        return path
