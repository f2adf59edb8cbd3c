"""Hook implementations of engine-gemma. Imports nothing heavy."""

import engine


@engine.hookimpl
def register_models(register):
    register("Gemma3ForCausalLM", "engine_gemma.gemma3:Gemma3ForCausalLM")
