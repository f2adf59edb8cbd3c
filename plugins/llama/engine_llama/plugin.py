"""Hook implementations of engine-llama. Imports nothing heavy."""

import engine

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@engine.hookimpl
def register_models(register):
    for architecture in ARCHITECTURES:
        register(architecture, f"engine_llama.model:{architecture}")
