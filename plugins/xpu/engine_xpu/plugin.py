"""Hook implementations of engine-xpu. Imports nothing heavy."""

import engine


@engine.hookimpl
def register_platforms(register):
    register("xpu", "engine_xpu.platform:XpuPlatform")


@engine.hookimpl
def register_quantizers(register):
    register("mxfp8", "engine_xpu.quantizer:Mxfp8Quantizer")
