"""Hook implementations of engine-gptq. Imports nothing heavy."""

import engine


@engine.hookimpl
def register_quantizers(register):
    register("gptq", "engine_gptq.quantizer:GptqQuantizer")
