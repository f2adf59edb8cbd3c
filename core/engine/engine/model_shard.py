"""A rank's part of the engine: its shard of the model, the KV cache, the runner, and the
cache blocks in the tiers' canonical layout. Rank 0's ``LLMEngine`` holds one; every other
tensor-parallel rank runs one (``engine.engine.workers``). Built by :func:`build_shard`."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from engine.distributed.executor import ControlChannel
from engine.distributed.parallel_state import SINGLE, TensorParallel, tensor_parallel
from engine.engine.memory_plan import MemoryBudget, budget_kv_cache, measure_activation_peak
from engine.engine.setup import EngineSetup
from engine.interfaces.model import Model
from engine.runtime.batch import ModelOutput, ScheduledBatch
from engine.runtime.graphs import DecodeGraphs, graph_batch_sizes
from engine.runtime.kv_cache import KVCache
from engine.runtime.kv_tier_connector import CanonicalBlocks, tier_spec
from engine.runtime.model_builder import (
    build_kv_cache,
    construct_model,
    load_model,
    refuse_batch_variant_layers,
    select_backends,
)
from engine.runtime.model_runner import ModelRunner

logger = logging.getLogger("engine")


class StepHandle:
    """The sampled tokens of a step that was started: :meth:`result` waits for them."""

    def __init__(self, future: Future[ModelOutput]) -> None:
        self._future = future

    @classmethod
    def failed(cls, exc: BaseException) -> StepHandle:
        future: Future[ModelOutput] = Future()
        future.set_exception(exc)
        return cls(future)

    def done(self) -> bool:
        return self._future.done()

    def result(self) -> ModelOutput:
        return self._future.result()


@dataclass
class ModelShard:
    model: Model
    kv_cache: KVCache
    runner: ModelRunner
    device: torch.device
    tp: TensorParallel = SINGLE
    channel: ControlChannel | None = None
    kv_blocks: CanonicalBlocks | None = None  # a worker rank's side of rank 0's KV tier
    executor: ThreadPoolExecutor | None = None  # async execution: the forward on its own thread

    def execute(self, batch: ScheduledBatch) -> StepHandle:
        """Start the step's forward and sampling; without async execution it has run when
        this returns. The caller must not change the batch's requests until the result."""
        if self.executor is not None:
            return StepHandle(self.executor.submit(self.runner.execute, batch))
        future: Future[ModelOutput] = Future()
        try:
            future.set_result(self.runner.execute(batch))
        except BaseException as exc:
            future.set_exception(exc)
        return StepHandle(future)

    def close(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=True)
            self.executor = None
        self.runner.close()


def local_device_index(platform, tp: TensorParallel) -> int:
    """The device this rank uses: ``LOCAL_RANK`` under torchrun, else the rank."""
    if not tp.is_parallel or platform.device_type == "cpu":
        return 0
    return int(os.environ.get("LOCAL_RANK", tp.rank))


def decode_graphs_of(setup: EngineSetup, model: Model, tp: TensorParallel, backends=()):
    """The platform's device-graph factory when decode steps are to be captured, else None
    (the platform has none, ``--enforce-eager``, an attention backend of ``backends`` (``(spec,
    layers, class)``) that cannot be captured, or a case graphs do not cover yet: logged)."""
    make_graph = setup.platform.device_graphs()
    if make_graph is None:
        return None
    reason = None
    uncapturable = sorted({cls.name for _, _, cls in backends if not cls.capabilities.graph_capturable})
    if setup.config.enforce_eager:
        reason = "--enforce-eager"
    elif tp.is_parallel:
        reason = "tensor parallelism"
    elif setup.proposer_cls is not None:
        reason = "speculative decoding (its proposers read hidden states the graphs do not keep)"
    elif any(spec.is_recurrent for spec in model.kv_cache_specs()):
        reason = "recurrent attention layers (their padding rows would need a state of their own)"
    elif uncapturable:
        reason = (
            f"attention backend {', '.join(uncapturable)} builds its step metadata on the host (choose "
            f"--attention-backend triton_paged to capture decode graphs)"
        )
    if reason is not None:
        logger.info("decode steps run eagerly: %s", reason)
        return None
    return make_graph


def profiled_kv_cache_bytes(setup: EngineSetup, model: Model, platform, cache_of: Callable[..., KVCache]) -> int:
    """The KV cache's bytes by ``--gpu-memory-utilization``: the share of the device less what
    is in use now (the weights loaded) and a profiled forward's activation peak.
    ``cache_of(memory, max_model_len=, max_num_seqs=)`` builds a KV cache as the engine's."""
    config = setup.config
    info = platform.memory_info()

    def profile_cache(max_model_len: int, num_seqs: int) -> KVCache:
        # the free memory as the budget: the cache is capped at what num_seqs sequences can use
        return cache_of(info.free_bytes, max_model_len=max_model_len, max_num_seqs=num_seqs)

    peak = measure_activation_peak(
        model,
        platform,
        profile_cache,
        num_tokens=config.max_num_batched_tokens,
        max_model_len=setup.max_model_len,
        max_num_seqs=config.max_num_seqs,
        block_size=config.block_size,
    )
    budget = MemoryBudget(
        total_bytes=info.total_bytes,
        utilization=config.gpu_memory_utilization,
        in_use_bytes=info.total_bytes - info.free_bytes,
        activation_peak_bytes=peak,
        profile_tokens=config.max_num_batched_tokens,
    )
    return budget_kv_cache(budget)


def build_shard(
    setup: EngineSetup,
    *,
    tp: TensorParallel = SINGLE,
    channel: ControlChannel | None = None,
    progress: bool = True,
    before_weights: Callable[[Model], None] | None = None,
    async_execution: bool = False,
) -> ModelShard:
    """Construct the model (quantized), choose each layer group's attention backend, let
    ``before_weights`` check it (what needs its cache layout: speculation, the KV tier), load
    the weights, then size and allocate the KV cache (the same block count on every rank)."""
    config, platform = setup.config, setup.platform
    device = platform.device(local_device_index(platform, tp))
    with tensor_parallel(tp):
        model = construct_model(
            setup.model_cls, setup.hf_config, setup.dtype_name, device, quantizer=setup.quantizer, tp=tp
        )
        # each layer group's attention backend, chosen (or refused, with the reason) before the weights
        backends = select_backends(
            model.kv_cache_specs(),
            setup.components,
            platform,
            setup.dtype_name,
            config.block_size,
            config.attention_backend,
            config.batch_invariant,
            config.kv_cache_dtype,
        )
        if config.batch_invariant:
            refuse_batch_variant_layers(model)
        if before_weights is not None:
            before_weights(model)
        load_model(
            model,
            setup.model_path,
            platform,
            setup.dtype_name,
            progress=progress and tp.rank == 0,
            dequantizer=setup.dequantizer,
            batch_invariant=config.batch_invariant,
        )
        if setup.dequantizer is not None:
            logger.info(
                "dequantized %d %s weights to %s while loading%s",
                setup.dequantizer.dequantized,
                setup.raw_config["quantization_config"]["quant_method"],
                setup.dtype_name,
                f"; {setup.dequantizer.kept} kept quantized for {setup.quantizer.name}" if setup.quantizer else "",
            )
            if setup.dequantizer.dropped:
                logger.info(
                    "left out %d static activation scales (input_scale): activations are quantized as "
                    "the kernels run, or not at all for dense weights",
                    setup.dequantizer.dropped,
                )
        cache_of = functools.partial(
            build_kv_cache,
            model,
            setup.components,
            platform,
            setup.dtype_name,
            device,
            config.block_size,
            backends=backends,
            batch_invariant=config.batch_invariant,
            kv_cache_dtype=config.kv_cache_dtype,
            state_snapshots=config.num_state_snapshots if config.enable_prefix_caching else 0,
            snapshot_interval=config.state_snapshot_interval,
        )
        if config.kv_cache_memory is not None:
            memory = int(config.kv_cache_memory * 2**30)
        elif config.kv_cache_memory_fraction is not None:
            memory = int(platform.memory_info().free_bytes * config.kv_cache_memory_fraction)
        elif platform.memory_stats() is not None:
            memory = profiled_kv_cache_bytes(setup, model, platform, cache_of)
        else:
            memory = platform.default_kv_cache_bytes()
        make_graph = decode_graphs_of(setup, model, tp, backends or ())
        kv_cache = cache_of(
            memory,
            max_model_len=setup.max_model_len,
            max_num_seqs=config.max_num_seqs,
            agree=channel.agree_on_min if channel is not None else None,
            spare_blocks=1 if make_graph is not None else 0,  # where the graphs' padding rows write
        )
    kv_blocks = None
    if tp.rank != 0 and config.kv_tier is not None:  # rank 0 holds the tier; this rank gives and takes its heads
        kv_blocks = CanonicalBlocks(kv_cache, tier_spec(kv_cache, setup.salt, setup.dtype), tp)
    runner = ModelRunner(model, kv_cache, device, channel=channel)
    if make_graph is not None:
        runner.graphs = DecodeGraphs(
            model,
            kv_cache,
            device,
            graph_batch_sizes(config.max_num_seqs, config.cuda_graph_max_bs),
            max_model_len=setup.max_model_len,
            block_size=config.block_size,
            make_graph=make_graph,
        )
        runner.graphs.capture(progress=progress)
    executor = None
    if async_execution:  # under OpenMP the intra-op thread count is per calling thread: keep this one's
        executor = ThreadPoolExecutor(
            1,
            thread_name_prefix="engine-forward",
            initializer=torch.set_num_threads,
            initargs=(torch.get_num_threads(),),
        )
    return ModelShard(model, kv_cache, runner, device, tp, channel, kv_blocks, executor)
