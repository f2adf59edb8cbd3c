"""Hook implementations of engine-cuda. Imports nothing heavy."""

import engine


@engine.hookimpl
def register_platforms(register):
    register("cuda", "engine_cuda.platform:CudaPlatform")


@engine.hookimpl
def register_attention_backends(register):
    register("flashinfer", "engine_cuda.flashinfer_attention:FlashInferPagedAttention")
    register("flash_attn", "engine_cuda.flash_attention:FlashAttnPagedAttention")


@engine.hookimpl
def register_quantizers(register):
    register("fp8", "engine_cuda.fp8:Fp8Quantizer")
    # one format of the method: other plugins serve its other formats (pack-quantized: engine-compressed-tensors)
    register("compressed-tensors/float-quantized", "engine_cuda.fp8:CompressedTensorsFp8Quantizer")
