"""Hook implementations of engine-gguf. Imports nothing heavy."""

import engine


@engine.hookimpl
def register_quantizers(register):
    register("gguf", "engine_gguf.quantizer:GgufQuantizer")
