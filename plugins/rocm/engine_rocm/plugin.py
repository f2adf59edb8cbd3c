"""Hook implementations of engine-rocm. Imports nothing heavy."""

import engine


@engine.hookimpl
def register_platforms(register):
    register("rocm", "engine_rocm.platform:RocmPlatform")


@engine.hookimpl
def register_attention_backends(register):
    register("aiter_mha", "engine_rocm.aiter_attention:AiterPagedAttention")
