"""The model kit (``engine.testing.kit.ModelTests``) fails for broken models.

Each variant subclasses engine-llama's ``LlamaForCausalLM`` with one bug and is
registered as ``LlamaForCausalLM`` by a throwaway plugin module (a dotted module
path, so the real llama plugin is not loaded in that run). The kit then runs
against it in an inner pytest session (a subprocess); each variant must fail
exactly the kit checks listed in ``CAUGHT_BY`` and pass the others.

Which check catches which bug:

- ``unbroken`` (engine-llama's class as is, through the same throwaway plugin):
  nothing; the harness itself does not make checks fail.
- ``decode_off_by_one`` (decode-only steps rotate q/k at position - 1):
  ``test_cached_decode_equals_recompute`` and ``test_prefix_hits_equal_recompute``
  (whose requests decode after their hits), through their logprob comparison
  (about 2e-3 off; on these tiny models the greedy tokens still agree).
- ``skips_post_attention_norm`` (``load_weights`` drops every
  ``post_attention_layernorm.weight`` yet reports it filled):
  ``test_all_weight_names_consumed`` (the parameter is left unloaded), and
  ``test_logits_match_transformers`` because the kit's checkpoint randomises
  norm weights (HF initialises them to 1, which an unloaded norm also holds).
- ``wrong_rms_eps`` (every RMSNorm uses eps 1e-5 instead of config's 1e-6):
  ``test_logits_match_transformers`` only; the model agrees with itself.
- ``hard_codes_rope_theta`` (rotary with base 10000 whatever the config says; the kit moves
  it to 2500): ``test_logits_match_transformers`` only.
- ``ties_untied_lm_head`` (shares the embedding as lm_head although the config
  does not tie, so the checkpoint's ``lm_head.weight`` is silently dropped):
  ``test_all_weight_names_consumed`` (changing that tensor changes nothing)
  and ``test_logits_match_transformers``.
- ``forgets_o_proj_all_reduce`` (the attention output projections keep each rank's partial
  sum): ``test_two_tensor_parallel_ranks_equal_one`` only; one rank has nothing to sum.
- ``chunk_restarts_positions`` (a prompt chunk that continues cached tokens is rotated from
  position 0): ``test_chunked_prefill_equals_whole_prefill`` and
  ``test_prefix_hits_equal_recompute`` (a prompt after a prefix hit is such a chunk); whole
  prompts and one-token decode steps are right.
- ``swaps_gate_up`` (``load_weights`` puts ``gate_proj`` where ``up_proj`` goes and back;
  every tensor is used and every parameter filled): ``test_logits_match_transformers`` only.
- ``norm_over_the_whole_step`` (the final RMSNorm takes one RMS over every token of the
  step instead of one per token): ``test_logits_match_transformers`` (a batch of prompts is
  one step), ``test_cached_decode_equals_recompute``, ``test_prefix_hits_equal_recompute``
  and ``test_chunked_prefill_equals_whole_prefill`` (steps group tokens differently).
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from xml.etree import ElementTree

import pytest

KIT_TESTS = (
    "test_discoverable",
    "test_logits_match_transformers",
    "test_cached_decode_equals_recompute",
    "test_prefix_hits_equal_recompute",
    "test_chunked_prefill_equals_whole_prefill",
    "test_all_weight_names_consumed",
    "test_two_tensor_parallel_ranks_equal_one",
)

CAUGHT_BY = {
    "unbroken": set(),
    "decode_off_by_one": {"test_cached_decode_equals_recompute", "test_prefix_hits_equal_recompute"},
    "skips_post_attention_norm": {"test_all_weight_names_consumed", "test_logits_match_transformers"},
    "wrong_rms_eps": {"test_logits_match_transformers"},
    "hard_codes_rope_theta": {"test_logits_match_transformers"},
    "ties_untied_lm_head": {"test_all_weight_names_consumed", "test_logits_match_transformers"},
    "forgets_o_proj_all_reduce": {"test_two_tensor_parallel_ranks_equal_one"},
    "chunk_restarts_positions": {"test_chunked_prefill_equals_whole_prefill", "test_prefix_hits_equal_recompute"},
    "swaps_gate_up": {"test_logits_match_transformers"},
    "norm_over_the_whole_step": {
        "test_logits_match_transformers",
        "test_cached_decode_equals_recompute",
        "test_prefix_hits_equal_recompute",
        "test_chunked_prefill_equals_whole_prefill",
    },
}

BROKEN_MODELS = '''
import torch

import engine
from engine.layers.layernorm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine_llama.model import LlamaForCausalLM


def step_common(ctx):
    """The step's CommonAttentionMetadata (the cpu backend keeps it as .common of its metadata)."""
    metadata = ctx.metadata[0]
    return getattr(metadata, "common", metadata)


def decode_only(ctx):
    """Whether every sequence in this step adds one token."""
    return step_common(ctx).max_query_len == 1


class unbroken(LlamaForCausalLM):
    pass


class decode_off_by_one(LlamaForCausalLM):
    def forward(self, input_ids, positions, ctx):
        if decode_only(ctx):
            positions = positions - 1  # [T]: rotary one position early, in decode only
        return super().forward(input_ids, positions, ctx)


class skips_post_attention_norm(LlamaForCausalLM):
    def load_weights(self, weights):
        skipped = "post_attention_layernorm.weight"
        loaded = super().load_weights((n, t) for n, t in weights if not n.endswith(skipped))
        return loaded | {n for n, _ in self.named_parameters() if n.endswith(skipped)}


class wrong_rms_eps(LlamaForCausalLM):
    def __init__(self, init):
        super().__init__(init)
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.eps = 1e-5


class hard_codes_rope_theta(LlamaForCausalLM):
    def __init__(self, init):
        super().__init__(init)
        params = {"rope_type": "default", "rope_theta": 10000.0}
        self.rotary = RotaryEmbedding(self.dims.head_dim, self.rotary.max_positions, params)


class ties_untied_lm_head(LlamaForCausalLM):
    def __init__(self, init):
        super().__init__(init)
        self.tie_word_embeddings = True  # its load_weights now drops lm_head.weight
        self.lm_head.weight = self.model.embed_tokens.weight


class forgets_o_proj_all_reduce(LlamaForCausalLM):
    def __init__(self, init):
        super().__init__(init)
        for layer in self.model.layers:
            layer.self_attn.o_proj.reduce = False


class chunk_restarts_positions(LlamaForCausalLM):
    def forward(self, input_ids, positions, ctx):
        common = step_common(ctx)
        chunk = common.query_lens[common.token_seq] > 1  # [T]: tokens of a multi-token query
        positions = torch.where(chunk, common.token_row, positions)  # its row, not its position
        return super().forward(input_ids, positions, ctx)


class swaps_gate_up(LlamaForCausalLM):
    def load_weights(self, weights):
        swap = {".mlp.gate_proj.": ".mlp.up_proj.", ".mlp.up_proj.": ".mlp.gate_proj."}

        def renamed(name):
            for old, new in swap.items():
                if old in name:
                    return name.replace(old, new)
            return name

        return super().load_weights((renamed(n), t) for n, t in weights)


class StepRMSNorm(RMSNorm):
    def forward(self, x, residual=None, ops=None):
        if residual is not None:
            x = residual = x + residual
        rms = x.float().pow(2).mean().add(self.eps).rsqrt()  # one RMS for the step, not one per token
        out = self.weight * (x.float() * rms).to(x.dtype)
        return out if residual is None else (out, residual)


class norm_over_the_whole_step(LlamaForCausalLM):
    def __init__(self, init):
        super().__init__(init)
        self.model.norm = StepRMSNorm(self.dims.hidden_size, self.dims.rms_norm_eps, init.dtype)


@engine.hookimpl
def register_models(register):
    register("LlamaForCausalLM", VARIANT)
'''

KIT_CLASS = """
class TestKit_{variant}(ModelTests):
    plugin = {plugin!r}
    architecture = "LlamaForCausalLM"
"""


@pytest.fixture(scope="module")
def kit_outcomes(tmp_path_factory) -> tuple[dict[str, dict[str, str]], str]:
    """Runs the kit once per variant in one pytest subprocess: ``{variant: {check: outcome}}``
    (outcome "passed", "failure", "error" or "skipped"), and the run's output.

    Each variant's plugin module is written to a fresh folder on the subprocess's
    ``sys.path`` (PYTHONPATH) and named by its dotted module path; only it and the
    cpu plugin are loaded, so the installed llama plugin never registers its
    ``LlamaForCausalLM`` there. (A subprocess rather than pytester's in-process
    run: that drops modules the run imported, and torch cannot import them twice.)
    """
    root = tmp_path_factory.mktemp("kit_catches_bugs")
    suffix = uuid.uuid4().hex[:8]
    classes = ["from engine.testing.kit import ModelTests"]
    for variant in CAUGHT_BY:
        module = f"kit_broken_{variant}_{suffix}"
        (root / f"{module}.py").write_text(BROKEN_MODELS.replace("VARIANT", variant))
        classes.append(KIT_CLASS.format(variant=variant, plugin=module))
    (root / "test_model_kit.py").write_text("\n".join(classes))
    env = {k: v for k, v in os.environ.items() if k not in ("ENGINE_PLUGINS", "ENGINE_TRACE_PLUGINS")}
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    report = root / "report.xml"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", "test_model_kit.py"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,  # rc 1: checks fail
    )
    assert report.is_file(), proc.stdout + proc.stderr
    outcomes: dict[str, dict[str, str]] = {variant: {} for variant in CAUGHT_BY}
    for case in ElementTree.parse(report).iter("testcase"):
        variant = case.get("classname").rsplit(".", 1)[-1].removeprefix("TestKit_")
        result = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        outcomes[variant][case.get("name")] = result
    return outcomes, proc.stdout[-6000:]


@pytest.mark.parametrize("variant", sorted(CAUGHT_BY))
def test_kit_fails_exactly_the_checks_that_see_the_bug(variant, kit_outcomes):
    outcomes, log = kit_outcomes
    expected = {test: "failure" if test in CAUGHT_BY[variant] else "passed" for test in KIT_TESTS}
    assert outcomes[variant] == expected, log
