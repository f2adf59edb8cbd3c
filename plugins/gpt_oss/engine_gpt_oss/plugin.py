"""Hook implementations of engine-gpt-oss. Imports nothing heavy."""

import engine


@engine.hookimpl
def register_models(register):
    register("GptOssForCausalLM", "engine_gpt_oss.gpt_oss:GptOssForCausalLM")
