"""``mtp``: speculative drafts from the target checkpoint's own multi-token-prediction block.

An MTP block predicts the token after next: from the target's hidden state at position ``t``
and the embedding of token ``t+1`` it computes a hidden state whose logits are a draft for
``t+2``. Drafting k tokens chains it: each draft's embedding and the block's own hidden state
(:meth:`MtpModule.chain_hidden`) give the next.

The block is architecture-specific; the proposer is not. A model plugin whose checkpoints
carry such a block registers it with ``register_models`` under ``"<Architecture>.mtp"``
(:func:`mtp_module_name`), as an :class:`MtpModule`; the proposer picks it by the target's
``architectures[0]``, builds it, loads the tensors under its :meth:`MtpModule.checkpoint_prefix`
(and the target's tensors it shares, :attr:`MtpModule.shared_tensors`) and drafts with it.

The block keeps its own paged cache. Each target request has a shadow request whose entries
are the positions the block has processed since the request started decoding (prompt
positions are never run through it), in order; rope uses the real positions. Before drafting,
the shadow keeps the longest run of entries whose tokens the target still has at those
positions, so rejected drafts and preemption roll back.

Settings (``--speculative-config``): ``kv_cache_memory`` (GiB for the block's cache,
default 0.25).
"""

from __future__ import annotations

import json
from abc import abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, Mapping, Sequence

import torch

from engine.interfaces.model import Model
from engine.interfaces.spec_proposer import FINAL_HIDDEN_STATES, DraftRequest, Drafts, ProposerInit, SpecProposer

if TYPE_CHECKING:
    from engine.model_config import HFConfig

SETTINGS = ("kv_cache_memory",)
MTP_SUFFIX = ".mtp"


def mtp_module_name(architecture: str) -> str:
    """The model-registry name of ``architecture``'s multi-token-prediction block."""
    return architecture + MTP_SUFFIX


class MtpModule(Model):
    """A checkpoint's multi-token-prediction block, run by the ``mtp`` proposer on one rank.

    Built as ``cls(config, dtype)`` from :meth:`module_config` of the target's ``config.json``,
    which says how many blocks the checkpoint has in its :attr:`config_key` field;
    :meth:`load_weights` receives the tensors under :meth:`checkpoint_prefix` with the prefix
    taken off, and the target's tensors named in :attr:`shared_tensors` under their names there.

    Before each :meth:`forward` the proposer sets ``previous_hidden`` ``[T, width]``: for the
    first draft the target's hidden states of :attr:`hidden_state_layer` (a
    ``hidden_state_layers`` entry of :mod:`engine.interfaces.spec_proposer`), for the next
    :meth:`chain_hidden` of the block's previous output. ``forward(input_ids, positions, ctx)``
    takes the token after each hidden state's position and the real positions, runs the
    block's attention on its own cache (:meth:`kv_cache_specs`) and returns what
    :meth:`compute_logits` reads. ``max_positions`` (an attribute or property) bounds the
    positions it can run.
    """

    config_key: ClassVar[str]  # the config.json field that says how many blocks the checkpoint has
    hidden_state_layer: ClassVar[int] = FINAL_HIDDEN_STATES
    shared_tensors: ClassVar[Mapping[str, str]] = {}  # target's tensor name -> name given to load_weights
    previous_hidden: torch.Tensor | None = None

    @classmethod
    @abstractmethod
    def checkpoint_prefix(cls, config: HFConfig) -> str:
        """The prefix of the block's tensors in the checkpoint (e.g. ``"mtp."``)."""

    @classmethod
    def module_config(cls, config: HFConfig) -> HFConfig:
        """The config the block is built from, given the target's ``config.json`` (default: that
        config; a multimodal checkpoint's text config, say)."""
        return config

    def chain_hidden(self, out: torch.Tensor) -> torch.Tensor:
        """What the next draft reads as its previous hidden state (default: ``out``)."""
        return out


class MtpProposer(SpecProposer):
    name = "mtp"
    hidden_state_layers = (FINAL_HIDDEN_STATES,)

    def __init__(self, init: ProposerInit) -> None:
        super().__init__(init)
        from safetensors import safe_open

        from engine.model_config import HFConfig
        from engine.model_loader.checkpoint import safetensors_files
        from engine.model_loader.dequant import CheckpointDequantizer, dequantizable, dequantize_stream
        from engine.model_loader.weights import load_tensors
        from engine.runtime.kv_cache_manager import KVCacheManager
        from engine.runtime.model_builder import build_kv_cache
        from engine.runtime.model_runner import ModelRunner

        unknown = sorted(set(init.config) - set(SETTINGS))
        if unknown:
            raise ValueError(f"mtp takes {', '.join(SETTINGS)}; unknown: {', '.join(unknown)}.")
        memory = init.config.get("kv_cache_memory", 0.25)
        raw = json.loads((init.target_model_path / "config.json").read_text(encoding="utf-8"))
        module_cls = self._module_class(init, (raw.get("architectures") or [""])[0])
        config = module_cls.module_config(HFConfig(raw))
        prefix = module_cls.checkpoint_prefix(config)
        files = safetensors_files(init.target_model_path)
        present = False
        for path in files:
            with safe_open(str(path), framework="pt", device="cpu") as handle:
                present = present or any(name.startswith(prefix) for name in handle.keys())
        declared = config.get(module_cls.config_key)
        if not declared or not present:
            raise ValueError(
                f"The checkpoint at {init.target_model_path} has no multi-token-prediction layer "
                f"({module_cls.config_key} is {declared!r}; tensors {prefix}*: "
                f"{'present' if present else 'none'}): --speculative-method mtp needs one."
            )
        self.layer = module_cls(config, init.dtype).to(init.device).eval()
        self.hidden_state_layers = (module_cls.hidden_state_layer,)
        shared = dict(module_cls.shared_tensors)

        def mtp_tensors():
            for path in files:
                with safe_open(str(path), framework="pt", device="cpu") as handle:
                    for name in handle.keys():
                        if name.startswith(prefix):
                            yield name[len(prefix) :], handle.get_tensor(name)
                        elif name in shared:
                            yield shared[name], handle.get_tensor(name)

        tensors = mtp_tensors()
        quantization = raw.get("quantization_config") or {}
        if quantization and dequantizable(quantization):  # a quantized checkpoint: as the target loads it
            tensors = dequantize_stream(tensors, CheckpointDequantizer(quantization, init.dtype))
        load_tensors(self.layer, tensors)
        dtype_name = str(init.dtype).removeprefix("torch.")
        self.kv_cache = build_kv_cache(
            self.layer,
            init.components,
            init.platform,
            dtype_name,
            init.device,
            init.block_size,
            int(memory * 2**30),
            max_model_len=self.layer.max_positions,
            max_num_seqs=256,
        )
        self.kv_manager = KVCacheManager(self.kv_cache.num_blocks, init.block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(self.layer, self.kv_cache, init.device)
        self.shadows: dict[str, tuple[Any, int]] = {}  # request id -> (shadow request, its first real position)

    @staticmethod
    def _module_class(init: ProposerInit, architecture: str) -> type[MtpModule]:
        """The MTP block registered for ``architecture``."""
        models = init.components.models if init.components is not None else None
        name = mtp_module_name(architecture)
        if models is None or name not in models:
            known = sorted(
                n.removesuffix(MTP_SUFFIX) for n in (models.names() if models else ()) if n.endswith(MTP_SUFFIX)
            )
            raise ValueError(
                f"--speculative-method mtp needs the target's multi-token-prediction block, but no model plugin "
                f"registers one for {architecture or 'the architecture'!r} (as {name!r}). Architectures with one: "
                f"{', '.join(known) or 'none'}. Install or load the plugin of the model's family."
            )
        cls = models.get(name)
        if not issubclass(cls, MtpModule):
            raise TypeError(
                f"The model {name!r} resolves to {cls!r}, which is not an engine.spec_decode.mtp.MtpModule."
            )
        return cls

    def _sync(self, request: DraftRequest) -> Any:
        """The shadow for ``request``: entries for positions first .. first + n - 1 whose tokens
        still agree with the target's; positions past them are dropped."""
        from engine.runtime.request import Request
        from engine.sampling_params import SamplingParams

        tokens = request.token_ids
        newest = len(tokens) - 1  # the position this round processes first
        found = self.shadows.get(request.request_id)
        if found is not None:
            shadow, first = found
            keep = 0
            while (
                keep < shadow.num_computed_tokens
                and first + keep < newest
                and shadow.token_ids[keep] == tokens[first + keep]
            ):
                keep += 1
            if keep:
                shadow.token_ids = shadow.token_ids[:keep]
                shadow.num_computed_tokens = keep
                if first + keep == newest:
                    return shadow, first
            self.kv_manager.free(shadow)  # a gap before the newest token (or nothing kept): start afresh
        shadow = Request(request.request_id, [tokens[-1]], SamplingParams(temperature=0.0))
        shadow.token_ids, shadow.num_computed_tokens = [], 0
        self.shadows[request.request_id] = (shadow, newest)
        return shadow, newest

    @torch.inference_mode()
    def propose(self, requests: Sequence[DraftRequest], num_tokens: int, hidden_states=None) -> Drafts:
        hidden = hidden_states[self.hidden_state_layers[0]]  # [B, ...]: the target's, for each newest token
        drafts: list[list[int]] = [[] for _ in requests]
        states = [self._sync(r) for r in requests]
        # step 0 processes each request's newest token; step j > 0 its previous draft
        inputs = [r.token_ids[-1] for r in requests]
        previous = list(hidden)
        active = list(range(len(requests)))
        for _ in range(num_tokens):
            rows = []
            for i in active:
                shadow, first = states[i]
                position = first + len(shadow.token_ids)
                if position >= self.layer.max_positions or not self.kv_manager.allocate(shadow, 1):
                    continue
                shadow.token_ids.append(inputs[i])
                rows.append((i, position))
            if not rows:
                break
            out = self._run(
                [states[i][0] for i, _ in rows],
                torch.tensor([p for _, p in rows]),
                torch.tensor([inputs[i] for i, _ in rows]),
                torch.stack([previous[i] for i, _ in rows]),
            )
            logits = self.layer.compute_logits(out)
            tokens = logits.argmax(dim=-1).tolist()
            for (i, _), token, h in zip(rows, tokens, self.layer.chain_hidden(out)):
                states[i][0].num_computed_tokens += 1
                drafts[i].append(token)
                inputs[i], previous[i] = token, h
            active = [i for i, _ in rows]
        return Drafts(drafts)

    def _run(
        self, shadows: list[Any], positions: torch.Tensor, input_ids: torch.Tensor, previous: torch.Tensor
    ) -> torch.Tensor:
        """One token for each shadow at its next cache slot, with rope at the real ``positions``."""
        from engine.runtime.batch import ScheduledBatch

        batch = ScheduledBatch(requests=shadows, num_tokens=[1] * len(shadows))
        _, _, common = self.runner.prepare(batch)
        self.layer.previous_hidden = previous
        self.layer.cache_positions = common.context_lens  # each shadow's own count of entries so far
        return self.layer(input_ids, positions, self.kv_cache.forward_context(common))

    def remove(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            found = self.shadows.pop(request_id, None)
            if found is not None:
                self.kv_manager.free(found[0])
