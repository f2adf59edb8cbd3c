"""The engine of one process: its components, resolved from an ``EngineConfig`` before
any weight is read, and the step loop."""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.distributed.executor import Launch
from engine.engine.cache_plan import CachePlan, plan_caches
from engine.engine.model_shard import ModelShard, StepHandle, build_shard
from engine.engine.output_processor import OutputProcessor, StepResult
from engine.engine.ranks import Ranks
from engine.engine.setup import EngineSetup, check_tensor_parallel, resolve_setup
from engine.engine.speculation import make_spec_decoder
from engine.engine.stats import EngineStats
from engine.engine.structured_output import StructuredOutputManager
from engine.interfaces.model import Model
from engine.model_loader.checkpoint import eos_token_ids
from engine.plugins.manager import EnginePluginManager, get_plugin_manager
from engine.runtime.batch import ScheduledBatch
from engine.runtime.kv_cache_manager import KVCacheManager
from engine.runtime.kv_tier_connector import KVTierConnector
from engine.runtime.reasoning import start_tracking
from engine.runtime.request import Request, RequestStatus
from engine.runtime.scheduler import Scheduler
from engine.sampling_params import SamplingParams
from engine.tokenizer import load_tokenizer

logger = logging.getLogger("engine")

__all__ = ["LLMEngine", "StepResult"]


def freeze_startup_objects() -> None:
    """Put what the process holds now (a served engine's modules, tensors and plugin objects,
    which live as long as it) out of the garbage collector's sight, after a full collection:
    the collections made while serving no longer walk them (they took about 3% of a CPU decode
    step). Called by ``engine serve`` and ``engine bench`` once their engine is built; objects
    frozen by an earlier call are looked at again first, so a process that builds engines one
    after another keeps no garbage frozen."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


class LLMEngine:
    """The engine of one process. With ``tensor_parallel_size`` > 1 this is rank 0, which
    spawns the other ranks (or meets them under torchrun); they each run a ``ModelShard``
    (``engine.engine.workers``)."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        plugin_manager: EnginePluginManager | None = None,
        progress: bool = True,
        launch: Launch | None = None,
    ) -> None:
        self.config = config
        self.plugin_manager = plugin_manager or get_plugin_manager(config.plugins)
        self.setup: EngineSetup = resolve_setup(config, self.plugin_manager.components())
        if launch is not None:  # a worker rank runs a shard (engine.engine.workers.run_worker), not an engine
            check_tensor_parallel(self.setup, launch)
            if launch.rank != 0:
                raise ValueError(f"Rank {launch.rank} runs engine.engine.workers.run_worker, not an LLMEngine.")
        self.setup.platform.configure_process()
        # --async-scheduling, else the platform's default (on where a device runs the forward)
        self.async_scheduling = (
            config.async_scheduling
            if config.async_scheduling is not None
            else type(self.setup.platform).async_scheduling_default
        )
        self.shard: ModelShard | None = None
        self._in_flight: InFlightStep | None = None  # async scheduling: the step whose forward runs now
        self._ready: list[StepResult] = []  # a step finished early (_drain), returned by the next step()
        self.kv_tier: KVTierConnector | None = None
        self.cache_plan: CachePlan | None = None
        loaded = [
            info.name if info.source == "entry_point" else info.module
            for info in self.plugin_manager.plugin_infos
            if info.loaded
        ]
        self.ranks = Ranks(self.setup, loaded, in_step=lambda: self.shard is not None and self.shard.runner.in_step)
        try:
            self._build(progress)
        except BaseException:
            if self.cache_plan is not None and self.cache_plan.tier is not None:
                self.cache_plan.tier.close()
            self.ranks.stop(failed=True)  # the other ranks would wait on this one for ever
            raise

    def _build(self, progress: bool) -> None:
        setup, config = self.setup, self.config
        self.ranks.join(setup.platform.dist_backend)
        setup.platform.seed_everything(config.seed)
        self.shard = build_shard(
            setup,
            tp=self.ranks.tp,
            channel=self.ranks.channel,
            progress=progress,
            before_weights=self._plan_caches,
            async_execution=self.async_scheduling,
        )
        kv_cache = self.shard.kv_cache
        self.kv_manager = KVCacheManager(
            kv_cache.num_blocks,
            config.block_size,
            enable_prefix_caching=self.cache_plan.prefix_caching,
            salt=setup.salt,
            num_state_slots=kv_cache.num_state_slots,
            num_state_snapshots=kv_cache.num_state_snapshots,
            snapshot_interval=config.state_snapshot_interval,
        )
        if self.cache_plan.tier is not None:
            tier = self.cache_plan.tier
            self.kv_tier = KVTierConnector(
                tier, kv_cache, self.kv_manager, tier.spec, tp=self.ranks.tp, channel=self.ranks.channel
            )
        self.spec = make_spec_decoder(setup, self.shard)
        self.scheduler = Scheduler(
            self.kv_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            max_model_len=setup.max_model_len,
            spec=self.spec,
        )
        self.tokenizer = load_tokenizer(config.tokenizer or setup.model_path)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.chat_encoder = type(self.model).chat_encoder  # None: the tokenizer's chat template
        self.eos_token_ids = eos_token_ids(setup.model_path, setup.raw_config)
        self.structured_output = StructuredOutputManager(
            setup.structured_output_cls,
            tokenizer=self.tokenizer,
            vocab_size=setup.vocab_size,
            eos_token_ids=self.eos_token_ids,
            config=config.structured_output_config,
            compile_timeout=config.structured_output_compile_timeout,
            max_constraint_chars=config.structured_output_max_constraint_chars,
            max_rollback=config.num_speculative_tokens if self.spec is not None else 0,
            disable_any_whitespace=config.structured_output_disable_any_whitespace,
        )
        self.shard.runner.structured_output = self.structured_output
        logger.info(
            "engine ready: %s on %s (%s), %d KV blocks of %d tokens%s",
            setup.architecture,
            setup.platform.name,
            setup.dtype_name,
            kv_cache.num_blocks,
            config.block_size,
            f", tensor-parallel rank {self.tp.rank} of {self.tp.size}" if self.tp.is_parallel else "",
        )

    def _plan_caches(self, model: Model) -> None:
        self.cache_plan = plan_caches(self.setup, model, self.ranks.tp.rank)

    # what the rest of the engine reads

    model = property(lambda self: self.shard.model)
    kv_cache = property(lambda self: self.shard.kv_cache)
    runner = property(lambda self: self.shard.runner)
    device = property(lambda self: self.shard.device)
    tp = property(lambda self: self.ranks.tp)
    requests = property(lambda self: self.output_processor.requests)
    request_groups = property(lambda self: self.output_processor.request_groups)
    model_path = property(lambda self: self.setup.model_path)
    hf_config = property(lambda self: self.setup.hf_config)
    architecture = property(lambda self: self.setup.architecture)
    platform = property(lambda self: self.setup.platform)
    dtype_name = property(lambda self: self.setup.dtype_name)
    dtype = property(lambda self: self.setup.dtype)
    max_model_len = property(lambda self: self.setup.max_model_len)
    vocab_size = property(lambda self: self.setup.vocab_size)
    quantizer = property(lambda self: self.setup.quantizer)
    dequantizer = property(lambda self: self.setup.dequantizer)

    def check_ranks(self) -> None:
        """Raise ``WorkerDiedError`` when a spawned rank has exited."""
        self.ranks.check()

    def stats(self) -> EngineStats:
        """A snapshot of the scheduler and the KV cache, for metrics."""
        scheduler, kv = self.scheduler, self.kv_manager
        return EngineStats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            kv_cache_usage=kv.usage,
            num_free_blocks=kv.num_free_blocks,
            prefix_cache_queries=kv.stats.queries,
            prefix_cache_hits=kv.stats.hits,
            num_preemptions=scheduler.num_preemptions,
        )

    def close(self) -> None:
        """Release what outlives a step: the KV tier (pending stores finish first), the
        forward thread, and the other tensor-parallel ranks (told to stop, then joined)."""
        self._drain()
        if self.kv_tier is not None:
            self.kv_tier.close()
            self.kv_tier = None
        if getattr(self, "structured_output", None) is not None:
            self.structured_output.close()
        if self.shard is not None:
            self.shard.close()
        self.ranks.stop()

    # requests

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        prompt: str | None = None,
        want_prompt_logits: bool = False,
        parent_request_id: str | None = None,
        index: int = 0,
        group: str | None = None,
    ) -> Request:
        """Add one sequence (``params.n`` must be 1; ``add_request_group`` takes any n). ``group``
        names the client request it is part of: the scheduler shares seats fairly between groups."""
        self._drain()
        if params.n != 1:
            raise ValueError(
                f"SamplingParams(n={params.n}) asks for {params.n} sequences; add it with add_request_group."
            )
        if self.output_processor.in_use(request_id):
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
            request_id,
            prompt_token_ids,
            params,
            eos_token_ids=self.eos_token_ids,
            priority=priority,
            prompt=prompt,
            want_prompt_logits=want_prompt_logits,
            parent_request_id=parent_request_id,
            index=index,
            group=group,
        )
        if params.structured_outputs is not None:  # compiled once per constraint (the server compiles first)
            request.grammar = self.structured_output.matcher(params.structured_outputs)
        start_tracking(request)
        self.output_processor.add(request)
        if self.kv_tier is not None:
            self.kv_tier.prefetch(request)
        self.scheduler.add(request)
        return request

    def add_request_group(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        prompt: str | None = None,
        group: str | None = None,
    ) -> list[Request]:
        """Add ``params.n`` independent samples of one prompt, as requests ``"{i}_{request_id}"``
        (``parent_request_id=request_id``, ``index=i``, params ``params.for_sample(i)``: seed + i).
        With n == 1 it is ``[add_request(request_id, ...)]``. ``abort(request_id)`` aborts them all."""
        if params.n == 1:
            return [
                self.add_request(request_id, prompt_token_ids, params, priority=priority, prompt=prompt, group=group)
            ]
        if self.output_processor.in_use(request_id):
            raise ValueError(f"Request id {request_id!r} is already in use.")
        samples: list[Request] = []
        try:
            for i in range(params.n):
                samples.append(
                    self.add_request(
                        f"{i}_{request_id}",
                        prompt_token_ids,
                        params.for_sample(i),
                        priority=priority,
                        prompt=prompt,
                        parent_request_id=request_id,
                        index=i,
                        group=group,
                    )
                )
        except BaseException:
            for request in samples:
                self.abort(request.request_id)
            raise
        self.output_processor.add_group(request_id, samples)
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
        self._drain()
        for request in self.request_groups.get(request_id, []):
            self.abort(request.request_id)
        request = self.requests.get(request_id)
        if request is not None:
            if not request.status.finished:
                self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
            self.output_processor.forget(request)

    def has_unfinished(self) -> bool:
        return bool(self._ready) or self._in_flight is not None or self.scheduler.has_unfinished()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix block, so that later prompts are computed afresh (running
        requests keep their blocks and contents; they just stop being shared)."""
        self._drain()
        self.kv_manager.reset_prefix_cache()

    # the loop

    def step(self) -> StepResult:
        """schedule → execute → update_from_output → process. With async scheduling the next
        step is scheduled while this one's forward runs, and started before this one's result
        is handed back, so that the engine's and the caller's work overlap the forwards."""
        self.ranks.check()
        if self._ready:  # finished early by _drain
            return self._ready.pop()
        step, self._in_flight = self._in_flight or self._start(), None
        result = self._finish(step, then=self._schedule_ahead(step) if self.async_scheduling else None)
        if self.async_scheduling and self._in_flight is None and self.scheduler.has_unfinished():
            self._in_flight = self._start()  # scheduled after this step: it needed this step's outcome
        return result

    def _schedule_ahead(self, step: InFlightStep) -> tuple[ScheduledBatch, float] | None:
        """The next step's batch, scheduled while ``step``'s forward runs, and the time it took."""
        started = time.perf_counter()
        batch = self.scheduler.schedule_ahead(step.batch)
        return None if batch is None else (batch, time.perf_counter() - started)

    def _start(self, batch: ScheduledBatch | None = None, schedule_seconds: float = 0.0) -> InFlightStep:
        started = time.perf_counter()
        try:
            if batch is None:
                batch = self.scheduler.schedule()
            if self.kv_tier is not None:
                self.kv_tier.offload_evicted()  # before this step's forward overwrites the evicted blocks
        except Exception as exc:  # raised by the step that waits for it, as without async scheduling
            return InFlightStep(ScheduledBatch(), StepHandle.failed(exc), 0.0)
        scheduled = time.perf_counter()
        return InFlightStep(batch, self.shard.execute(batch), schedule_seconds + scheduled - started)

    def _finish(self, step: InFlightStep, then: tuple[ScheduledBatch, float] | None = None) -> StepResult:
        """Wait for ``step``'s output, start ``then`` (the next step, scheduled meanwhile), and
        advance the requests by the output."""
        try:
            output = step.handle.result()
        except RuntimeError as exc:
            self.ranks.step_failed(exc)  # raises WorkerDiedError if a lost rank caused it
            raise
        if then is not None:
            self._in_flight = self._start(*then)
        executed = time.perf_counter()
        finished = self.scheduler.update_from_output(step.batch, output, self.output_processor.check)
        updated = time.perf_counter()
        result = self.output_processor.process(output, finished)
        timings = result.timings
        timings.schedule, timings.update = step.schedule_seconds, updated - executed
        timings.process = time.perf_counter() - updated
        return result

    def _drain(self) -> None:
        """Finish the step in flight (async scheduling) before the requests or the cache change;
        the next ``step()`` returns its result."""
        if self._in_flight is not None:
            step, self._in_flight = self._in_flight, None
            self._ready.append(self._finish(step))


@dataclass
class InFlightStep:
    batch: ScheduledBatch
    handle: StepHandle
    schedule_seconds: float
