"""Speculative decoding for an engine: its proposer, built once the target's weights are
loaded, and the ``SpecDecoder`` the scheduler plans drafts with."""

from __future__ import annotations

import logging

from engine.engine.model_shard import ModelShard
from engine.engine.setup import EngineSetup
from engine.errors import SelectionError
from engine.interfaces.spec_proposer import PRE_HEAD_HIDDEN_STATES, ProposerInit
from engine.spec_decode.decoder import SpecDecoder

logger = logging.getLogger("engine")


def make_spec_decoder(setup: EngineSetup, shard: ModelShard) -> SpecDecoder | None:
    """None without ``--speculative-method``; else the proposer, with the runner keeping the
    hidden states it reads."""
    config, runner = setup.config, shard.runner
    if setup.proposer_cls is None:
        return None
    proposer = setup.proposer_cls(
        ProposerInit(
            config=dict(config.speculative_config),
            target_model_path=setup.model_path,
            vocab_size=setup.vocab_size,
            dtype=setup.dtype,
            device=shard.device,
            components=setup.components,
            platform=setup.platform,
            block_size=config.block_size,
        )
    )
    runner.keep_hidden_states = bool(proposer.hidden_state_layers)
    if PRE_HEAD_HIDDEN_STATES in tuple(proposer.hidden_state_layers):
        if not type(shard.model).provides_pre_head_hidden_states:
            raise SelectionError(
                f"Proposer {setup.proposer_cls.name!r} reads the target's hidden states before its head, which "
                f"{setup.architecture} does not provide."
            )
        shard.model.keep_pre_head_hidden_states = True
        runner.keep_pre_head_hidden_states = True
    logger.info(
        "speculative decoding: proposer %s, up to %d drafts a step",
        setup.proposer_cls.name,
        config.num_speculative_tokens,
    )
    return SpecDecoder(
        proposer,
        config.num_speculative_tokens,
        config.max_num_batched_tokens,
        setup.max_model_len,
        setup.vocab_size,
        hidden_states=runner.last_hidden,
    )
