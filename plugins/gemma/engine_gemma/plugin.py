"""Hook implementations of engine-gemma. Imports nothing heavy."""

import engine


@engine.hookimpl
def register_models(register):
    register("Gemma3ForCausalLM", "engine_gemma.gemma3:Gemma3ForCausalLM")
    register("Gemma3ForConditionalGeneration", "engine_gemma.gemma3_multimodal:Gemma3ForConditionalGeneration")
