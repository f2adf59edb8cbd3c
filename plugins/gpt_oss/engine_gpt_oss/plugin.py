"""Hook implementations of engine-gpt-oss. Imports nothing heavy."""

import engine


@engine.hookimpl
def register_models(register):
    register("GptOssForCausalLM", "engine_gpt_oss.gpt_oss:GptOssForCausalLM")


@engine.hookimpl
def register_quantizers(register):
    # gpt-oss's quant_method: MXFP4 experts kept in their values rather than dequantized at load
    register("mxfp4", "engine_gpt_oss.gpt_oss:Mxfp4Quantizer")
