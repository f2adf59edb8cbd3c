"""Hook implementations of engine-llama. Imports nothing heavy."""

import engine

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
TOOL_PARSERS = {"hermes": "HermesToolParser", "llama3_json": "Llama3JsonToolParser", "mistral": "MistralToolParser"}
REASONING_PARSERS = {"qwen3": "Qwen3ReasoningParser"}


@engine.hookimpl
def register_models(register):
    for architecture in ARCHITECTURES:
        register(architecture, f"engine_llama.model:{architecture}")


@engine.hookimpl
def register_tool_parsers(register):
    for name, cls in TOOL_PARSERS.items():
        register(name, f"engine_llama.parsers:{cls}")


@engine.hookimpl
def register_reasoning_parsers(register):
    for name, cls in REASONING_PARSERS.items():
        register(name, f"engine_llama.parsers:{cls}")
