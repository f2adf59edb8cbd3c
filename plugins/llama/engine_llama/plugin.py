"""Hook implementations of engine-llama. Imports nothing heavy."""

import engine

# architecture -> the module of engine_llama defining it
ARCHITECTURES = {
    "LlamaForCausalLM": "model",
    "MistralForCausalLM": "model",
    "Qwen2ForCausalLM": "model",
    "Qwen3ForCausalLM": "model",
    "Qwen3MoeForCausalLM": "moe",
    "MixtralForCausalLM": "moe",
    "Phi3ForCausalLM": "phi3",
}
TOOL_PARSERS = {"hermes": "HermesToolParser", "llama3_json": "Llama3JsonToolParser", "mistral": "MistralToolParser"}
REASONING_PARSERS = {"qwen3": "Qwen3ReasoningParser"}


@engine.hookimpl
def register_models(register):
    for architecture, module in ARCHITECTURES.items():
        register(architecture, f"engine_llama.{module}:{architecture}")


@engine.hookimpl
def register_tool_parsers(register):
    for name, cls in TOOL_PARSERS.items():
        register(name, f"engine_llama.parsers:{cls}")


@engine.hookimpl
def register_reasoning_parsers(register):
    for name, cls in REASONING_PARSERS.items():
        register(name, f"engine_llama.parsers:{cls}")
