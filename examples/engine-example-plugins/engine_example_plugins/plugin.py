"""Hook implementations only: nothing heavy is imported here."""

import engine


@engine.hookimpl
def register_attention_backends(register):
    # imported on first use, not when the plugin loads
    register("example_torch_paged", "engine_example_plugins.attention:TorchPagedAttention")


@engine.hookimpl
def register_kv_tiers(register):
    register("example_sqlite", "engine_example_plugins.sqlite_tier:SqliteKVTier")


@engine.hookimpl
def register_quantizers(register):
    register("example_int8", "engine_example_plugins.int8_quantizer:Int8Quantizer")


@engine.hookimpl
def register_spec_proposers(register):
    register("example_random", "engine_example_plugins.random_proposer:RandomProposer")
