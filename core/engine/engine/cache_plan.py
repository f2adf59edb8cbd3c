"""What a constructed model's cache layout decides before its weights are read: whether
prefix caching can stay on, whether speculation can run, and the KV tier (made here, so
that its settings are checked before the weights load)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from engine.engine.setup import EngineSetup
from engine.errors import SelectionError
from engine.interfaces.model import Model
from engine.runtime.kv_tier_connector import tier_spec_of

logger = logging.getLogger("engine")


@dataclass(frozen=True)
class CachePlan:
    prefix_caching: bool
    recurrent_kinds: list[str]  # the model's attention kinds that keep one state per request
    tier: Any  # the KV tier (rank 0), or None


def plan_caches(setup: EngineSetup, model: Model, rank: int) -> CachePlan:
    config = setup.config
    specs = model.kv_cache_specs()
    recurrent_kinds = sorted({spec.kind for spec in specs if spec.is_recurrent})
    prefix_caching = config.enable_prefix_caching
    if recurrent_kinds and prefix_caching:
        # a prefix hit also needs the state of those layers at the prefix's end: snapshots of it
        # are kept at block boundaries (engine.runtime.kv_cache_manager)
        interval = config.state_snapshot_interval
        if interval % config.block_size:
            raise SelectionError(
                f"--state-snapshot-interval {interval} is not a multiple of --block-size {config.block_size}: "
                f"{setup.architecture}'s {', '.join(recurrent_kinds)} states are kept at block boundaries."
            )
        if config.num_state_snapshots == 0:
            logger.info(
                "prefix caching is off for %s: --num-state-snapshots 0 keeps no state of its %s layers",
                setup.architecture,
                ", ".join(recurrent_kinds),
            )
            prefix_caching = False
    if recurrent_kinds and setup.proposer_cls is not None:
        # the runner keeps each drafted request's state from before the step and puts it back when
        # a draft is rejected; the kept tokens are then recomputed (engine.runtime.model_runner)
        logger.info(
            "speculative decoding on %s: a step whose drafts are partly rejected puts its %s state back and "
            "recomputes the kept tokens with the next step",
            setup.architecture,
            ", ".join(recurrent_kinds),
        )
    tier = None
    if setup.kv_tier_cls is not None and config.kv_cache_dtype != "auto":
        raise SelectionError(
            f"KV tiers carry blocks in the compute dtype; --kv-cache-dtype {config.kv_cache_dtype} caches are not "
            f"offloaded yet. Run without --kv-tier, or with --kv-cache-dtype auto."
        )
    if setup.kv_tier_cls is not None:
        if rank == 0:  # the other ranks give and take their heads of rank 0's blocks
            spec = tier_spec_of(specs, config.block_size, setup.salt, setup.dtype)
            tier = setup.kv_tier_cls(spec, config.kv_tier_config)
            logger.info(
                "KV tier %s (%s): blocks of %d bytes, digest %s",
                config.kv_tier,
                setup.kv_tier_cls.__name__,
                spec.block_bytes,
                spec.digest,
            )
            if spec.state_numels:
                logger.info(
                    "KV tier %s: %s state snapshots of %d bytes, in %d blocks each",
                    config.kv_tier,
                    ", ".join(recurrent_kinds),
                    spec.state_bytes,
                    spec.state_blocks,
                )
    return CachePlan(prefix_caching, recurrent_kinds, tier)
