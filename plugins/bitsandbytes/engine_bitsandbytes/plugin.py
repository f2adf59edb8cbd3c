"""Hook implementations of engine-bitsandbytes. Imports nothing heavy."""

import engine


@engine.hookimpl
def register_quantizers(register):
    register("bitsandbytes", "engine_bitsandbytes.quantizer:BitsAndBytesQuantizer")
