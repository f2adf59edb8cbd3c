"""Hook implementations of engine-compressed-tensors. Imports nothing heavy."""

import engine


@engine.hookimpl
def register_quantizers(register):
    # one format of quant_method compressed-tensors: the engine looks up "<quant_method>/<format>" first
    register("compressed-tensors/pack-quantized", "engine_compressed_tensors.quantizer:PackQuantizedQuantizer")
    # MXFP4 routed experts (Kimi-K3's), kept in their values instead of dequantized at load
    register("compressed-tensors/mxfp4-pack-quantized", "engine_compressed_tensors.mxfp4:Mxfp4Quantizer")
