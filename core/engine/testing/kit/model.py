"""``ModelTests``: a model plugin's network checked against HF transformers and itself.

Every check runs the real engine (``LLM``) on a tiny random-weight checkpoint of
the architecture, in fp32 on the cpu platform by default. Where the tiny config keeps
transformers' plain rope base of 10000, the checkpoint uses 2500 instead (unless
``config_overrides`` sets a rope field), so a model that hard-codes the default instead of
reading the config fails:

- the model class is registered as an engine ``Model``;
- prompt logits equal HF transformers' forward on the same weights;
- decode steps that read the KV cache give what one recompute pass gives;
- chunked prefill gives what a whole-prompt prefill gives;
- requests that start from a cached prefix (recurrent layers: from a snapshot of their
  state) give what one recompute pass gives;
- ``load_weights`` uses every checkpoint tensor and fills every parameter;
- a model that declares ``supports_tensor_parallel`` gives on two ranks (gloo, spawned
  processes) the logits it gives on one.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any, ClassVar

import pytest

from engine.testing.kit.base import KitTests, capability_skip

PROMPT_LENGTHS = (3, 8, 17, 30)
NUM_GENERATED = 12
NUM_TOP_LOGPROBS = 5


# transformers' default rope base, which a model might hard-code instead of reading the config,
# and the base the kit's checkpoints use instead
DEFAULT_ROPE_THETA, MOVED_ROPE_THETA = 10000.0, 2500.0
ROPE_FIELDS = ("rope_parameters", "rope_theta", "rope_scaling")


def moved_defaults(config: Any, overrides: dict[str, Any]) -> dict[str, Any]:
    """Config overrides that move a plain rope base (``rope_parameters["rope_theta"]``,
    10000 -> 2500) off transformers' default where the tiny config keeps it and ``overrides``
    sets no rope field, so a model that hard-codes the default instead of reading the config
    differs from transformers."""
    rope = getattr(config, "rope_parameters", None)
    if any(field in overrides for field in ROPE_FIELDS) or not isinstance(rope, dict):
        return {}
    if rope.get("rope_theta") != DEFAULT_ROPE_THETA:
        return {}
    return {"rope_parameters": {**rope, "rope_theta": MOVED_ROPE_THETA}}


def tolerance(reference: Any, atol: float) -> float:
    """``atol`` scaled by the reference's magnitude when it is above 1."""
    return atol * max(1.0, reference.abs().max().item())


class ModelTests(KitTests):
    """Subclass with ``plugin`` (the providing plugin) and ``architecture`` (the name it
    registers, as in ``config.json``'s ``architectures``).

    ``platform_plugins``: plugins loaded next to ``plugin`` so the engine has a platform
    and attention backends. ``config_overrides``: fields changed in the tiny config.
    ``ignored_checkpoint_tensors``: regexes of checkpoint tensor names the model may
    legitimately drop (e.g. precomputed buffers). ``atol``: the logit tolerance (raise it
    with ``dtype`` other than float32).

    Architectures without an entry in ``engine.testing.checkpoints.TINY_CONFIGS``
    override the fixture, keeping its scope::

        @pytest.fixture(scope="class")
        @classmethod
        def checkpoint(cls, tmp_path_factory):
            path = tmp_path_factory.mktemp("my_arch")
            ...  # save config.json + safetensors there
            return path, hf_model_or_None  # None skips the transformers comparison
    """

    registry_name = "models"
    architecture: ClassVar[str | None] = None
    platform_plugins: ClassVar[tuple[str, ...]] = ("cpu",)
    dtype: ClassVar[str] = "float32"
    config_overrides: ClassVar[dict[str, Any]] = {}
    ignored_checkpoint_tensors: ClassVar[tuple[str, ...]] = (r"rotary_emb\.inv_freq$",)
    atol: ClassVar[float] = 1e-4  # fp32 logits, relative to their magnitude when above 1

    # fixtures and helpers

    @pytest.fixture(scope="class")
    @classmethod
    def checkpoint(cls, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
        """``(checkpoint folder, HF reference model or None)``, made once per class."""
        from engine.testing.checkpoints import TINY_CONFIGS, make_tiny_checkpoint

        architecture = cls.architecture
        if architecture is None:
            raise NotImplementedError(f"{cls.__name__} must set the class attribute 'architecture'.")
        if architecture not in TINY_CONFIGS:
            raise NotImplementedError(
                f"{cls.__name__}: engine.testing.checkpoints has no tiny config for {architecture}; "
                f"override the `checkpoint` fixture to make a tiny checkpoint of {architecture}."
            )
        import transformers

        config_class = getattr(transformers, architecture).config_class
        moved = moved_defaults(
            config_class(**{**TINY_CONFIGS[architecture], **cls.config_overrides}), cls.config_overrides
        )
        path = tmp_path_factory.mktemp(architecture)
        # norm weights and biases are random too, so unloaded ones show in the logits
        hf_model = make_tiny_checkpoint(architecture, path, dtype=cls.dtype, **cls.config_overrides, **moved)
        return path, hf_model

    def make_llm(self, path: Path, **kwargs: Any) -> Any:
        from engine import LLM

        plugins = [self.required("plugin"), *self.platform_plugins]
        return LLM(str(path), plugins=plugins, dtype=self.dtype, kv_cache_memory=0.05, progress=False, **kwargs)

    def prompts(self, path: Path, seed: int) -> list[list[int]]:
        """Random token ids, one prompt per length in ``PROMPT_LENGTHS``."""
        config = json.loads((path / "config.json").read_text())
        vocab_size = int(config.get("vocab_size") or config["text_config"]["vocab_size"])  # multimodal: nested
        rng = random.Random(seed)
        return [[rng.randrange(vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]

    # checks

    def test_discoverable(self) -> None:
        """The plugin registers the architecture, and it resolves to an engine ``Model`` subclass."""
        from engine.interfaces.model import Model

        cls = self.resolve(self.required("architecture"))
        assert isinstance(cls, type) and issubclass(cls, Model)

    def test_logits_match_transformers(self, checkpoint: tuple[Path, Any]) -> None:
        """Prompt logits of a varlen batch equal HF transformers' forward on the same weights."""
        import torch

        path, hf_model = checkpoint
        if hf_model is None:
            pytest.skip("the checkpoint fixture gave no HF reference model")
        prompts = self.prompts(path, seed=0)
        for prompt, logits in zip(prompts, self.make_llm(path).prompt_logits(prompts)):
            with torch.no_grad():
                reference = hf_model(torch.tensor([prompt])).logits[0].float()  # [len, vocab]
            assert logits.shape == reference.shape
            error = (logits - reference).abs().max().item()
            assert error <= tolerance(reference, self.atol), (
                f"prompt of {len(prompt)} tokens: logits differ from transformers by {error:.3g}"
            )

    def test_cached_decode_equals_recompute(self, checkpoint: tuple[Path, Any]) -> None:
        """Greedy decode steps that read the KV cache produce the tokens and logprobs that one
        uncached pass over prompt + output produces at the same positions (the logprobs also
        catch a divergence too small to change the greedy tokens)."""
        from engine import SamplingParams

        path, _ = checkpoint
        prompts = self.prompts(path, seed=1)
        llm = self.make_llm(path)
        params = SamplingParams(temperature=0.0, max_tokens=NUM_GENERATED, ignore_eos=True, logprobs=NUM_TOP_LOGPROBS)
        outputs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        self.check_against_recompute(llm, prompts, outputs)

    def test_prefix_hits_equal_recompute(self, checkpoint: tuple[Path, Any]) -> None:
        """Prompts sharing a 37-token prefix, sent one after another to an engine with prefix
        caching (block size 4; recurrent layers' state kept every 8 tokens): the later ones
        start from cached blocks, and their greedy tokens and logprobs are those of one
        recompute pass, as in :meth:`test_cached_decode_equals_recompute`."""
        from engine import SamplingParams

        path, _ = checkpoint
        prefix = sum(self.prompts(path, seed=4), [])[:37]
        suffixes = self.prompts(path, seed=5)
        prompts = [prefix + suffix for suffix in suffixes] + [prefix + suffixes[0]]  # the last: a repeat
        llm = self.make_llm(path, block_size=4, state_snapshot_interval=8)
        params = SamplingParams(temperature=0.0, max_tokens=NUM_GENERATED, ignore_eos=True, logprobs=NUM_TOP_LOGPROBS)
        outputs = [llm.generate([p], params, use_tqdm=False)[0].outputs[0] for p in prompts]
        stats = llm.engine.kv_manager.stats
        assert stats.hits >= 32 * (len(prompts) - 1), (
            f"{stats.hits} of {stats.queries} prompt tokens came from the prefix cache; each prompt after the "
            f"first shares at least 32 (36 in blocks, 32 at the snapshots every 8 tokens)"
        )
        self.check_against_recompute(llm, prompts, outputs)

    def check_against_recompute(self, llm: Any, prompts: list[list[int]], outputs: list[Any]) -> None:
        """Each output's greedy tokens and logprobs against one uncached pass over prompt + output."""
        sequences = [p + o.token_ids for p, o in zip(prompts, outputs)]
        recomputed = llm.prompt_logits(sequences)  # [len(seq), vocab] each, one pass, no cache reuse
        for prompt, output, logits in zip(prompts, outputs, recomputed):
            assert len(output.token_ids) == NUM_GENERATED
            # row P-1+j scores generated token j
            rows = logits[len(prompt) - 1 : -1]  # [N, vocab]
            reference = rows.log_softmax(dim=-1)
            atol = tolerance(rows, self.atol)
            for j, (token, decoded) in enumerate(zip(output.token_ids, output.logprobs)):
                best = rows[j].max().item()
                assert rows[j, token].item() >= best - atol, (
                    f"prompt of {len(prompt)} tokens, output token {j}: decode chose {token}, the recompute "
                    f"prefers {rows[j].argmax().item()} by {best - rows[j, token].item():.3g}"
                )
                for token_id, logprob in decoded.items():
                    error = abs(logprob.logprob - reference[j, token_id].item())
                    assert error <= atol, (
                        f"prompt of {len(prompt)} tokens, output token {j}: decode logprob of token {token_id} "
                        f"differs from the recompute by {error:.3g}"
                    )

    def test_chunked_prefill_equals_whole_prefill(self, checkpoint: tuple[Path, Any]) -> None:
        """Prompts split into chunks of a 7-token step budget (so chunks start mid-prompt and
        attend to earlier chunks through the cache) give the logits of one whole-prompt step."""
        path, _ = checkpoint
        prompts = self.prompts(path, seed=2)
        whole = self.make_llm(path).prompt_logits(prompts)
        chunked = self.make_llm(path, max_num_batched_tokens=7).prompt_logits(prompts)
        for prompt, a, b in zip(prompts, whole, chunked):
            assert a.shape == b.shape
            error = (a - b).abs().max().item()
            assert error <= tolerance(a, self.atol), (
                f"prompt of {len(prompt)} tokens: chunked prefill differs from whole prefill by {error:.3g}"
            )

    def test_two_tensor_parallel_ranks_equal_one(self, checkpoint: tuple[Path, Any]) -> None:
        """With ``supports_tensor_parallel``, prompt logits on two ranks (each holding its part of
        every layer, spawned processes talking over gloo) equal those on one rank."""
        if not getattr(self.resolve(self.required("architecture")), "supports_tensor_parallel", False):
            capability_skip("tensor parallelism (Model.supports_tensor_parallel)")
        path, _ = checkpoint
        prompts = self.prompts(path, seed=3)
        one = self.make_llm(path).prompt_logits(prompts)
        with self.make_llm(path, tensor_parallel_size=2) as llm:
            two = llm.prompt_logits(prompts)
        for prompt, a, b in zip(prompts, one, two):
            assert a.shape == b.shape
            error = (a - b).abs().max().item()
            assert error <= tolerance(a, self.atol), (
                f"prompt of {len(prompt)} tokens: two tensor-parallel ranks differ from one by {error:.3g}"
            )

    def test_all_weight_names_consumed(self, checkpoint: tuple[Path, Any]) -> None:
        """``load_weights`` fills every parameter (none keeps its pre-load value) and uses every
        checkpoint tensor: changing any one tensor changes the loaded model."""
        import torch
        from safetensors.torch import load_file

        from engine.interfaces.model import ModelInit
        from engine.model_config import HFConfig
        from engine.model_loader.checkpoint import safetensors_files

        path, _ = checkpoint
        cls = self.resolve(self.required("architecture"))
        config = HFConfig(json.loads((path / "config.json").read_text()))
        dtype = getattr(torch, self.dtype)
        tensors: dict[str, torch.Tensor] = {}
        for file in safetensors_files(path):
            tensors.update(load_file(str(file)))

        def load(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            model = cls(ModelInit(config=config, dtype=dtype, device=torch.device("cpu")))
            with torch.no_grad():
                for param in model.parameters():
                    # a parameter the load leaves alone stays NaN (integer ones: the smallest value)
                    param.fill_(float("nan") if param.is_floating_point() else torch.iinfo(param.dtype).min)
            loaded = model.load_weights(iter(weights.items()))
            names = {name for name, _ in model.named_parameters()}
            assert loaded is not None and names <= set(loaded), (
                f"load_weights does not report these parameters as filled: {sorted(names - set(loaded or ()))}"
            )
            state = {name: value.detach().clone() for name, value in model.state_dict().items()}
            unfilled = sorted(
                name
                for name, p in model.named_parameters()
                if (torch.isnan(p).any() if p.is_floating_point() else (p == torch.iinfo(p.dtype).min).any())
            )
            assert not unfilled, f"load_weights reports these parameters filled but left them unloaded: {unfilled}"
            return state

        baseline = load(tensors)
        generator = torch.Generator().manual_seed(0)
        ignored = [n for n in tensors if any(re.search(p, n) for p in self.ignored_checkpoint_tensors)]
        unused = []
        for name in sorted(set(tensors) - set(ignored)):
            tensor = tensors[name]
            if tensor.is_floating_point():
                changed = tensor + 1.0 + torch.rand(tensor.shape, generator=generator).to(tensor.dtype)
            else:
                changed = tensor + 1
            state = load({**tensors, name: changed})
            if all(torch.equal(state[key], baseline[key]) for key in baseline):
                unused.append(name)
        assert not unused, f"load_weights ignores these checkpoint tensors (changing them changes nothing): {unused}"
