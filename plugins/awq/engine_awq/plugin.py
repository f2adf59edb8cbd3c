"""Hook implementations of engine-awq. Imports nothing heavy."""

import engine


@engine.hookimpl
def register_quantizers(register):
    register("awq", "engine_awq.quantizer:AwqQuantizer")
