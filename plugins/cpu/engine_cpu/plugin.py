"""Hook implementations of engine-cpu. Imports nothing heavy."""

import engine


@engine.hookimpl
def register_platforms(register):
    register("cpu", "engine_cpu.platform:CpuPlatform")


@engine.hookimpl
def register_attention_backends(register):
    register("cpu_paged", "engine_cpu.attention:CpuPagedAttention")
    register("cpu_mla", "engine_cpu.mla:CpuMlaAttention")
    register("cpu_indexer", "engine_cpu.indexer:CpuIndexer")
    register("cpu_kda", "engine_cpu.kda:CpuKdaAttention")
    register("cpu_mamba2", "engine_cpu.mamba2:CpuMamba2")
