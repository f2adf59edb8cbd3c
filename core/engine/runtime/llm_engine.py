"""The engine: plugins and components wired together, and the step loop."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from engine.config import EngineConfig
from engine.distributed.executor import (
    STUCK_STEP_GRACE_S,
    ControlChannel,
    Launch,
    LocalWorkers,
    WorkerDiedError,
    free_local_address,
    join_group,
    leave_group,
    raised_by_collective,
    torchrun_launch,
)
from engine.distributed.parallel_state import SINGLE, TensorParallel, tensor_parallel
from engine.interfaces.model import Model, ModelInit
from engine.interfaces.attention import TOKEN_STATE
from engine.interfaces.quantizer import Quantizer
from engine.interfaces.spec_proposer import PRE_HEAD_HIDDEN_STATES, ProposerInit
from engine.layers.linear import apply_linear_method, quantize_model
from engine.layers.ops import REFERENCE_OPS
from engine.model_config import HFConfig
from engine.model_loader.checkpoint import checkpoint_dtype, eos_token_ids, resolve_model_path, safetensors_files
from engine.model_loader.dequant import CheckpointDequantizer, dequantizable
from engine.model_loader.weights import load_weights
from engine.plugins.manager import EnginePluginManager, get_plugin_manager
from engine.plugins.registry import ComponentError
from engine.runtime.kv_cache_manager import KVCacheManager, cache_salt
from engine.runtime.detokenizer import IncrementalDetokenizer, find_stop_string
from engine.runtime.kv_cache import KVCache, KVCacheGroup, group_layers, num_blocks_for
from engine.runtime.kv_tier_connector import CanonicalBlocks, KVTierConnector, tier_spec
from engine.runtime.model_runner import ModelRunner
from engine.runtime.request import Request, RequestStatus
from engine.runtime.scheduler import Scheduler
from engine.runtime.token_state import TokenStateCache
from engine.sampling_params import SamplingParams
from engine.spec_decode.decoder import SpecDecoder
from engine.selection import SelectionError, resolve_dtype, select_attention_backend, select_platform
from engine.tokenizer import load_tokenizer

logger = logging.getLogger("engine")

# quantization methods whose plugin is ours to name in an error, by quant_method
QUANTIZER_DISTRIBUTIONS = {"bitsandbytes": "engine-bitsandbytes", "mxfp8": "engine-xpu"}


@dataclass
class StepResult:
    """Requests that got a new token this step, and those that finished."""

    updated: list[Request]
    finished: list[Request]


class LLMEngine:
    """The engine of one process. With ``tensor_parallel_size`` > 1 this is rank 0, which
    spawns the other ranks (or meets them under torchrun); a worker rank builds the same
    engine with its ``launch`` and serves rank 0's steps (``engine.distributed.executor``)."""

    def __init__(
        self, config: EngineConfig, *, plugin_manager: EnginePluginManager | None = None, progress: bool = True,
        launch: Launch | None = None,
    ) -> None:
        self.config = config
        self.plugin_manager = plugin_manager or get_plugin_manager(config.plugins)
        components = self.plugin_manager.components()
        self.tp: TensorParallel = SINGLE
        self.channel: ControlChannel | None = None
        self.workers: LocalWorkers | None = None
        self.kv_tier = None

        self.model_path = resolve_model_path(config.model)
        with open(self.model_path / "config.json", encoding="utf-8") as f:
            raw_config = json.load(f)
        self.hf_config = HFConfig(raw_config)
        architectures = raw_config.get("architectures") or []
        if not architectures:
            raise SelectionError(f"{self.model_path / 'config.json'} lists no 'architectures'.")
        self.architecture = architectures[0]
        model_cls = components.models.get(self.architecture)

        self.platform = select_platform(components.platforms, config.device)
        self.platform.configure_process()
        if launch is None:
            launch = self._launch_ranks(model_cls)
        else:  # a worker rank
            if launch.world_size != config.tensor_parallel_size:
                raise ValueError(f"This process was started as rank {launch.rank} of {launch.world_size}, but "
                                 f"--tensor-parallel-size is {config.tensor_parallel_size}: make them equal.")
            self._check_tensor_parallel(model_cls)
        try:
            self._build(config, components, raw_config, model_cls, launch, progress)
        except BaseException:
            self._stop_ranks(failed=True)  # the other ranks would wait on this one for ever
            raise

    def _build(self, config: EngineConfig, components, raw_config: dict, model_cls: type[Model],
               launch: Launch | None, progress: bool) -> None:
        """Everything after the platform: join the ranks, load the model, size the caches."""
        if launch is not None:
            self.tp = join_group(launch, self.platform.dist_backend, self.workers)
            self.channel = ControlChannel(self.tp)
        self.device = self.platform.device(self.local_device_index())
        self.dtype_name = resolve_dtype(config.dtype, checkpoint_dtype(raw_config), self.platform)
        self.dtype: torch.dtype = getattr(torch, self.dtype_name)
        self.platform.seed_everything(config.seed)
        # Kimi's configs name it model_max_length; multimodal ones keep the language model's under text_config
        text_config = raw_config.get("text_config") or {}
        max_positions = int(raw_config.get("max_position_embeddings") or raw_config.get("model_max_length")
                            or text_config.get("max_position_embeddings") or text_config.get("model_max_length")
                            or 2048)
        self.max_model_len = config.max_model_len or max_positions
        if self.max_model_len > max_positions:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings={max_positions}."
            )

        self.dequantizer: CheckpointDequantizer | None = None  # set for checkpoints dequantized at load
        self.quantizer = self._make_quantizer(components, raw_config)
        with tensor_parallel(self.tp):
            self.model: Model = build_model(
                model_cls, self.hf_config, self.model_path, self.platform, self.dtype_name, self.device,
                quantizer=self.quantizer, progress=progress and self.tp.rank == 0, dequantizer=self.dequantizer,
            )
        if self.dequantizer is not None:
            logger.info("dequantized %d %s weights to %s while loading", self.dequantizer.dequantized,
                        raw_config["quantization_config"]["quant_method"], self.dtype_name)
        with tensor_parallel(self.tp):
            self.kv_cache = self._make_kv_cache(components)
        prefix_caching = config.enable_prefix_caching
        self.recurrent_kinds = sorted({spec.kind for spec in self.model.kv_cache_specs() if spec.is_recurrent})
        if self.recurrent_kinds and prefix_caching:
            logger.info("prefix caching is off for %s: its %s layers keep one state per request, which a cached "
                        "prefix's blocks cannot restore", self.architecture, ", ".join(self.recurrent_kinds))
            prefix_caching = False
        self.kv_manager = KVCacheManager(
            self.kv_cache.num_blocks,
            config.block_size,
            enable_prefix_caching=prefix_caching,
            salt=cache_salt(str(self.model_path.resolve()), self.architecture, self.dtype_name, config.block_size),
            num_state_slots=self.kv_cache.num_state_slots,
        )
        self.kv_tier = self._make_kv_tier(components)
        self.scheduler = Scheduler(self.kv_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(self.model, self.kv_cache, self.device, channel=self.channel)
        self.vocab_size = int(raw_config.get("vocab_size") or text_config.get("vocab_size") or 0)
        self.spec = self._make_spec_decoder(components)
        self.tokenizer = load_tokenizer(config.tokenizer or self.model_path)
        self.chat_encoder = type(self.model).chat_encoder  # None: the tokenizer's chat template
        self.eos_token_ids = eos_token_ids(self.model_path, raw_config)
        self.requests: dict[str, Request] = {}
        self.request_groups: dict[str, list[Request]] = {}  # n > 1: parent id -> its samples, while any runs
        logger.info(
            "engine ready: %s on %s (%s), %d KV blocks of %d tokens%s",
            self.architecture, self.platform.name, self.dtype_name, self.kv_cache.num_blocks, config.block_size,
            f", tensor-parallel rank {self.tp.rank} of {self.tp.size}" if self.tp.is_parallel else "",
        )

    # tensor parallelism

    def _launch_ranks(self, model_cls: type[Model]) -> Launch | None:
        """Rank 0's side of starting the ranks: None for one rank; under torchrun this
        process's launch; else spawn ranks 1..N-1 here and return rank 0's launch."""
        config, size = self.config, self.config.tensor_parallel_size
        launch = torchrun_launch()
        if launch is not None and launch.world_size != size:
            raise ValueError(f"This process was started as rank {launch.rank} of WORLD_SIZE={launch.world_size} "
                             f"(torchrun), but --tensor-parallel-size is {size}: make them equal.")
        if size == 1:
            return None
        self._check_tensor_parallel(model_cls)
        if launch is not None:
            return launch
        # the workers load exactly the plugins this process loaded, named explicitly
        loaded = [info.name if info.source == "entry_point" else info.module
                  for info in self.plugin_manager.plugin_infos if info.loaded]
        init_method = free_local_address()
        self.workers = LocalWorkers(config.model_copy(update={"plugins": loaded}), size, init_method,
                                    self._on_worker_death)
        return Launch(0, size, init_method)

    def _check_tensor_parallel(self, model_cls: type[Model]) -> None:
        """What more than one rank cannot run, refused on every rank before any joins."""
        if not getattr(model_cls, "supports_tensor_parallel", False):
            raise SelectionError(f"{self.architecture} does not support tensor parallelism (its plugin does not "
                                 f"shard it); run it with --tensor-parallel-size 1.")
        if self.config.speculative_method is not None:
            raise SelectionError("Speculative decoding is not supported with --tensor-parallel-size > 1 yet.")

    def local_device_index(self) -> int:
        """The device this rank uses: ``LOCAL_RANK`` under torchrun, else the rank."""
        if not self.tp.is_parallel or self.platform.device_type == "cpu":
            return 0
        return int(os.environ.get("LOCAL_RANK", self.tp.rank))

    def _on_worker_death(self, reason: str) -> None:
        """Called on the watchdog thread: a step waiting on the dead rank fails by itself
        (gloo sees the closed connection); one still stuck after a grace period ends the
        process, since a hung server is worse than a dead one."""
        def exit_if_stuck() -> None:
            runner = getattr(self, "runner", None)
            if runner is not None and runner.in_step:
                logger.critical("%s and the step waiting on it is stuck after %.0f s: exiting", reason,
                                STUCK_STEP_GRACE_S)
                os._exit(1)

        timer = threading.Timer(STUCK_STEP_GRACE_S, exit_if_stuck)
        timer.daemon = True
        timer.start()

    def check_ranks(self) -> None:
        """Raise ``WorkerDiedError`` when a spawned rank has exited (cheap: a flag the watchdog sets)."""
        if self.workers is not None and self.workers.failure is not None:
            raise WorkerDiedError(self.workers.failure)

    def _make_quantizer(self, components, raw_config: dict) -> Quantizer | None:
        """The checkpoint's own quantization method, else ``--quantization``'s, else None."""
        config = self.config
        checkpoint_config = raw_config.get("quantization_config")
        if checkpoint_config is not None:
            method = checkpoint_config.get("quant_method") if isinstance(checkpoint_config, dict) else None
            if not isinstance(method, str):
                raise SelectionError(
                    f"{self.model_path / 'config.json'} has a quantization_config without a quant_method string."
                )
            if config.quantization is not None and config.quantization != method:
                raise SelectionError(
                    f"The checkpoint is already quantized with {method!r}; --quantization {config.quantization} "
                    f"applies to unquantized checkpoints only."
                )
            if config.quantization_config:
                raise SelectionError(
                    "--quantization-config applies to on-the-fly quantization; this checkpoint's "
                    "quantization_config in config.json is used as it is."
                )
            if dequantizable(checkpoint_config) and method not in components.quantizers.names():
                # no kernels for this format here: the weights become dense in the compute dtype
                logger.info("the checkpoint is quantized with %r and no quantizer of that name is registered: "
                            "its weights are dequantized to %s at load", method, self.dtype_name)
                self.dequantizer = CheckpointDequantizer(checkpoint_config, self.dtype)
                return None
            try:
                quantizer_cls = components.quantizers.get(method)
            except ComponentError:
                install = QUANTIZER_DISTRIBUTIONS.get(method)
                hint = f"install {install} (pip install {install})" if install else (
                    f"install a plugin that registers the quantization method {method!r}"
                )
                raise SelectionError(
                    f"The checkpoint at {self.model_path} is quantized with {method!r} "
                    f"(quantization_config.quant_method), and no quantizer of that name is registered "
                    f"(registered: {', '.join(components.quantizers.names()) or 'none'}): {hint}, "
                    f"and select it if you pass --plugins."
                ) from None
            settings, prequantized = checkpoint_config, True
        elif config.quantization is not None:
            quantizer_cls = components.quantizers.get(config.quantization)
            settings, prequantized = config.quantization_config, False
        else:
            if config.quantization_config:
                raise SelectionError("--quantization-config was given without --quantization: name the method.")
            return None
        name = quantizer_cls.name
        self.platform.check_quantization(name)
        if quantizer_cls.supported_platforms is not None and self.platform.name not in quantizer_cls.supported_platforms:
            raise SelectionError(
                f"Quantization {name!r} does not run on platform {self.platform.name!r}; it supports "
                f"{', '.join(sorted(quantizer_cls.supported_platforms))}."
            )
        if self.dtype_name not in quantizer_cls.activation_dtypes:
            raise SelectionError(
                f"Quantization {name!r} computes in {', '.join(sorted(quantizer_cls.activation_dtypes))}, "
                f"not {self.dtype_name}; pass --dtype with one of those."
            )
        return quantizer_cls.from_config(dict(settings), prequantized=prequantized)

    def _make_spec_decoder(self, components) -> SpecDecoder | None:
        config = self.config
        if config.speculative_method is None:
            if config.speculative_config:
                raise SelectionError("--speculative-config was given without --speculative-method: name the proposer.")
            return None
        if self.recurrent_kinds:
            raise SelectionError(
                f"Speculative decoding is refused for {self.architecture}: its {', '.join(self.recurrent_kinds)} attention "
                f"layers keep a recurrent state that rejected drafts would corrupt (rolling it back is not "
                f"supported); run it without --speculative-method."
            )
        proposer_cls = components.spec_proposers.get(config.speculative_method)
        proposer = proposer_cls(ProposerInit(
            config=dict(config.speculative_config), target_model_path=self.model_path, vocab_size=self.vocab_size,
            dtype=self.dtype, device=self.device, components=components, platform=self.platform,
            block_size=config.block_size,
        ))
        self.runner.keep_hidden_states = bool(proposer.hidden_state_layers)
        if PRE_HEAD_HIDDEN_STATES in tuple(proposer.hidden_state_layers):
            if not type(self.model).provides_pre_head_hidden_states:
                raise SelectionError(
                    f"Proposer {proposer_cls.name!r} reads the target's hidden states before its head, which "
                    f"{self.architecture} does not provide."
                )
            self.model.keep_pre_head_hidden_states = True
            self.runner.keep_pre_head_hidden_states = True
        logger.info("speculative decoding: proposer %s, up to %d drafts a step", proposer_cls.name,
                    config.num_speculative_tokens)
        return SpecDecoder(proposer, config.num_speculative_tokens, self.kv_manager, config.max_num_batched_tokens,
                           self.max_model_len, self.vocab_size)

    def _make_kv_tier(self, components) -> KVTierConnector | None:
        config = self.config
        if config.kv_tier is None:
            if config.kv_tier_config:
                raise ValueError("kv_tier_config was given without kv_tier: name the tier (--kv-tier).")
            return None
        if not config.enable_prefix_caching:
            raise ValueError("A KV tier holds prefix-cache blocks: it needs prefix caching on.")
        keys_only = sorted({spec.kind for spec in self.model.kv_cache_specs() if not spec.has_values})
        if keys_only:
            raise SelectionError(
                f"KV tiers hold K/V blocks of MHA/GQA layers; {self.architecture} has {', '.join(keys_only)} layers, "
                f"whose caches (latent entries, indexer keys) they do not carry yet. Run it without --kv-tier."
            )
        spec = tier_spec(self.kv_cache, self.kv_manager.salt, self.dtype)
        if self.tp.rank != 0:  # rank 0 holds the tier; this rank gives and takes its KV heads of blocks
            self.kv_blocks = CanonicalBlocks(self.kv_cache, spec, self.tp)
            return None
        tier_cls = components.kv_tiers.get(config.kv_tier)
        tier = tier_cls(spec, config.kv_tier_config)
        logger.info("KV tier %s (%s): blocks of %d bytes, digest %s", config.kv_tier, tier_cls.__name__,
                    spec.block_bytes, spec.digest)
        return KVTierConnector(tier, self.kv_cache, self.kv_manager, spec, tp=self.tp, channel=self.channel)

    def close(self) -> None:
        """Release what outlives a step: the KV tier (pending stores finish first), and the
        other tensor-parallel ranks (told to stop, then joined)."""
        if self.kv_tier is not None:
            self.kv_tier.close()
            self.kv_tier = None
        self._stop_ranks()

    def _stop_ranks(self, failed: bool = False) -> None:
        """Rank 0: tell the other ranks to stop (unless one died or this rank ``failed``), join
        the spawned ones (terminating stragglers), leave the group."""
        if self.tp.rank != 0 or (not self.tp.is_parallel and self.workers is None):
            return
        channel, self.channel = self.channel, None
        if channel is not None and not failed and (self.workers is None or self.workers.failure is None):
            try:
                channel.send(("stop",))
            except Exception:  # a rank already gone
                logger.debug("telling the ranks to stop failed", exc_info=True)
        if self.workers is not None:
            self.workers.stop(timeout=2.0 if failed or self.workers.failure else 10.0)
            self.workers = None
        leave_group()

    def _make_kv_cache(self, components) -> KVCache:
        config = self.config
        if config.kv_cache_memory is not None:
            memory = int(config.kv_cache_memory * 2**30)
        elif config.kv_cache_memory_fraction is not None:
            memory = int(self.platform.memory_info().free_bytes * config.kv_cache_memory_fraction)
        else:
            memory = self.platform.default_kv_cache_bytes()
        return build_kv_cache(
            self.model, components, self.platform, self.dtype_name, self.device, config.block_size, memory,
            max_model_len=self.max_model_len, max_num_seqs=config.max_num_seqs, attention_backend=config.attention_backend,
            agree=self.channel.agree_on_min if self.channel is not None else None,
        )

    # requests

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *, priority: int = 0,
        prompt: str | None = None, want_prompt_logits: bool = False,
        parent_request_id: str | None = None, index: int = 0,
    ) -> Request:
        """Add one sequence (``params.n`` must be 1; ``add_request_group`` takes any n)."""
        if params.n != 1:
            raise ValueError(
                f"SamplingParams(n={params.n}) asks for {params.n} sequences; add it with add_request_group."
            )
        if request_id in self.requests or request_id in self.request_groups:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        if not prompt_token_ids:
            raise ValueError("The prompt is empty: give at least one token.")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"Prompt token ids must be in [0, {self.vocab_size}); got {bad[:5]}.")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"The prompt has {len(prompt_token_ids)} tokens; max_model_len is {self.max_model_len}, "
                f"which leaves no room for output."
            )
        self._check_params(params)
        request = Request(
            request_id, prompt_token_ids, params, eos_token_ids=self.eos_token_ids, priority=priority,
            prompt=prompt, want_prompt_logits=want_prompt_logits, parent_request_id=parent_request_id, index=index,
        )
        if self.tokenizer is not None:
            hold_back = 0 if params.include_stop_str_in_output else max(map(len, params.stop), default=1) - 1
            request.detokenizer = IncrementalDetokenizer(
                self.tokenizer, skip_special_tokens=params.skip_special_tokens, stop_hold_back=hold_back
            )
        self.requests[request_id] = request
        if self.kv_tier is not None:
            self.kv_tier.prefetch(request)
        self.scheduler.add(request)
        return request

    def add_request_group(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *, priority: int = 0,
        prompt: str | None = None,
    ) -> list[Request]:
        """Add ``params.n`` independent samples of one prompt, as requests ``"{i}_{request_id}"``
        (``parent_request_id=request_id``, ``index=i``, params ``params.for_sample(i)``: seed + i).
        With n == 1 it is ``[add_request(request_id, ...)]``. ``abort(request_id)`` aborts them all."""
        if params.n == 1:
            return [self.add_request(request_id, prompt_token_ids, params, priority=priority, prompt=prompt)]
        if request_id in self.requests or request_id in self.request_groups:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        samples: list[Request] = []
        try:
            for i in range(params.n):
                samples.append(self.add_request(
                    f"{i}_{request_id}", prompt_token_ids, params.for_sample(i), priority=priority, prompt=prompt,
                    parent_request_id=request_id, index=i,
                ))
        except BaseException:
            for request in samples:
                self.abort(request.request_id)
            raise
        self.request_groups[request_id] = samples
        return samples

    def _check_params(self, params: SamplingParams) -> None:
        if params.stop and self.tokenizer is None:
            raise ValueError(
                f"Stop strings {params.stop!r} need a tokenizer and the model at {self.model_path} has none; "
                f"use stop_token_ids or give tokenizer=PATH."
            )
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids must be in [0, {self.vocab_size}); got {bad[:5]}.")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.vocab_size:
                raise ValueError(f"{name}={value} exceeds the vocabulary size {self.vocab_size}.")

    def abort(self, request_id: str) -> None:
        """Abort a request, or all samples of an n > 1 request by its own id."""
        for request in self.request_groups.get(request_id, []):
            self.abort(request.request_id)
        request = self.requests.pop(request_id, None)
        if request is not None:
            if not request.status.finished:
                self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
            self._forget_group(request)
            if self.spec is not None:
                self._forget_spec_state([request])

    def _forget_group(self, request: Request) -> None:
        group = self.request_groups.get(request.parent_request_id) if request.parent_request_id else None
        if group is not None and all(r.status.finished for r in group):
            del self.request_groups[request.parent_request_id]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix block, so that later prompts are computed afresh (running
        requests keep their blocks and contents; they just stop being shared)."""
        self.kv_manager.reset_prefix_cache()

    # the loop

    def step(self) -> StepResult:
        started = time.perf_counter()
        self.check_ranks()
        batch = self.scheduler.schedule()
        if self.spec is not None:
            self.spec.plan(batch, self.runner.last_hidden)
        if self.kv_tier is not None:
            self.kv_tier.offload_evicted()  # before this step's forward overwrites the evicted blocks
        try:
            sampled_requests, kept = self.runner.execute(batch)
        except RuntimeError as exc:
            if not (self.tp.is_parallel and raised_by_collective(exc)):
                raise  # the step's own error (out of memory, a model bug), not a lost rank
            if self.workers is not None:
                time.sleep(0.5)  # let the watchdog see which rank went away
            reason = self.workers.failure if self.workers is not None and self.workers.failure else None
            raise WorkerDiedError(reason or f"a tensor-parallel rank went away during the step: {exc}") from exc
        for request, n in zip(batch.requests, batch.num_tokens):
            request.num_computed_tokens += n
        index = {id(r): i for i, r in enumerate(batch.requests)} if batch.drafts else {}
        finished = []
        for request, tokens in zip(sampled_requests, kept):
            if index:  # accepted drafts were computed with the right context: their KV stays
                request.num_computed_tokens += self.spec.record(batch, index[id(request)], request, tokens)
            for token in tokens:
                request.append_token(token)
                status = request.check_stop(self.max_model_len)
                if request.detokenizer is not None:
                    status = self._update_text(request, status)
                if status is not None:
                    self.scheduler.finish(request, status)
                    self.requests.pop(request.request_id, None)
                    self._forget_group(request)
                    finished.append(request)
                    break
        if self.spec is not None:
            decode_only = all(n == 1 for n in batch.num_tokens)  # prompt chunks cost differently per token
            self.spec.record_step(batch.total_tokens, time.perf_counter() - started, decode_only)
            self._forget_spec_state(finished)
        return StepResult(updated=sampled_requests, finished=finished)

    def _forget_spec_state(self, requests: list[Request]) -> None:
        if requests:
            self.spec.remove([r.request_id for r in requests])
            for request in requests:
                self.runner.last_hidden.pop(request.request_id, None)

    def _update_text(self, request: Request, status: RequestStatus | None) -> RequestStatus | None:
        """Detokenize the request's new token and apply its stop strings; returns the finish status."""
        detokenizer, params = request.detokenizer, request.sampling_params
        new_text = ""
        # as in vLLM, the token that stopped the request (EOS, stop_token_ids) stays out of the text
        if status is not RequestStatus.FINISHED_STOPPED or params.include_stop_str_in_output:
            new_text = detokenizer.add_token(request.token_ids[-1])
        if status is not None:
            new_text += detokenizer.flush()
        if params.stop and new_text and request.num_output_tokens > params.min_tokens:
            match = find_stop_string(detokenizer.output_text, len(new_text), params.stop, params.include_stop_str_in_output)
            if match is not None:
                request.stop_reason, end = match
                detokenizer.truncate(end)
                return RequestStatus.FINISHED_STOPPED
        return status


def build_model(
    model_cls: type[Model], hf_config: HFConfig, model_path, platform, dtype_name: str, device: torch.device, *,
    quantizer: Quantizer | None = None, progress: bool = True, dequantizer: CheckpointDequantizer | None = None,
) -> Model:
    """Construct a model, give its linear layers the quantizer's methods, load its
    checkpoint (dense from a quantized one with a ``dequantizer``), then switch its
    unquantized layers to the platform's linear method."""
    model = model_cls(ModelInit(config=hf_config, dtype=getattr(torch, dtype_name), device=device))
    model.eval()
    if quantizer is not None:
        quantized, declined = quantize_model(model, quantizer)
        logger.info("quantization %s: %d linear layers quantized, %d left as they are (%s)",
                    quantizer.name, len(quantized), len(declined), ", ".join(declined) or "none")
    load_weights(model, safetensors_files(model_path), progress=progress, dequantizer=dequantizer)
    linear_method = platform.linear_method(dtype_name)
    if linear_method is not None:
        apply_linear_method(model, linear_method)
    return model


def build_kv_cache(
    model: Model, components, platform, dtype_name: str, device: torch.device, block_size: int, memory_bytes: int,
    *, max_model_len: int, max_num_seqs: int, attention_backend: str | None = None,
    agree: Callable[[int], int] | None = None,
) -> KVCache:
    """The paged KV cache of ``model``: one group per distinct layer spec with the attention
    backend selected for it, as many blocks as ``memory_bytes`` holds (no more than
    ``max_num_seqs`` sequences of ``max_model_len`` can use)."""
    dtype = getattr(torch, dtype_name)
    specs = model.kv_cache_specs()
    groups = []
    # a requested backend serves the groups of the kinds it declares (a model may mix kinds: sparse
    # MLA and its indexer); the rest take the platform's preferences. One it serves none of is refused.
    requested_kinds = set()
    if attention_backend is not None:
        requested_kinds = set(components.attention_backends.get(attention_backend).capabilities.kinds)
        if not requested_kinds & {spec.kind for spec in specs}:
            requested_kinds = {spec.kind for spec in specs if spec.kind != TOKEN_STATE}  # validation says why not
    for spec, layers in group_layers(specs):
        if spec.kind == TOKEN_STATE:  # stored values, not attention: the core serves them everywhere
            backend_cls = TokenStateCache
        else:
            backend_cls = select_attention_backend(
                components.attention_backends, platform, spec, dtype=dtype_name, block_size=block_size,
                requested=attention_backend if spec.kind in requested_kinds else None,
            )
        groups.append(KVCacheGroup(spec, backend_cls(spec, block_size, dtype, device), layers))
        logger.info("attention kind %s: backend %s for %d layers", spec.kind, backend_cls.name, len(layers))
    element_size = torch.empty(0, dtype=dtype).element_size()
    # recurrent layers hold one state per running request, taken from the memory first
    num_state_slots = max_num_seqs if any(spec.is_recurrent for spec in specs) else 0
    state_bytes = sum(
        num_state_slots * spec.state_numel() * torch.empty(0, dtype=group.backend.cache_dtype(dtype)).element_size()
        * len(group.layer_indices)
        for group in groups for spec in [group.spec] if spec.is_recurrent
    )
    if state_bytes >= memory_bytes:
        raise ValueError(
            f"KV-cache memory of {memory_bytes / 2**30:.3f} GiB does not hold the recurrent states of "
            f"{max_num_seqs} requests ({state_bytes / 2**30:.3f} GiB); raise --kv-cache-memory or lower --max-num-seqs."
        )
    memory_bytes -= state_bytes
    blocks_per_seq = -(-max_model_len // block_size)
    num_blocks = num_blocks_for(specs, block_size, element_size, memory_bytes,
                                max_blocks_useful=max_num_seqs * blocks_per_seq)
    if agree is not None:  # tensor-parallel ranks: the same block numbering everywhere
        num_blocks = agree(num_blocks)
    if num_blocks * block_size < max_model_len:
        raise ValueError(
            f"The KV cache holds {num_blocks * block_size} tokens ({num_blocks} blocks), fewer than "
            f"max_model_len={max_model_len}: one long request could never run. Raise "
            f"--kv-cache-memory or lower --max-model-len."
        )
    ops = platform.layer_ops(dtype_name) or REFERENCE_OPS
    return KVCache(groups, len(specs), num_blocks, block_size, dtype, device, ops, allocate=platform.allocate_kv_cache,
                   num_state_slots=num_state_slots)
