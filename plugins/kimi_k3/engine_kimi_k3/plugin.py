"""Hook implementations of engine-kimi-k3. Imports nothing heavy."""

import engine


@engine.hookimpl
def register_models(register):
    register("KimiLinearForCausalLM", "engine_kimi_k3.kimi_linear:KimiLinearForCausalLM")
    register("KimiK3ForConditionalGeneration", "engine_kimi_k3.kimi_k3:KimiK3ForConditionalGeneration")


@engine.hookimpl
def register_tool_parsers(register):
    register("kimi_k2", "engine_kimi_k3.parsers.kimi_k2:KimiK2ToolParser")
    register("kimi_k3", "engine_kimi_k3.parsers.kimi_k3:KimiK3ToolParser")


@engine.hookimpl
def register_reasoning_parsers(register):
    register("kimi", "engine_kimi_k3.parsers.reasoning:KimiReasoningParser")
    register("kimi_k3", "engine_kimi_k3.parsers.reasoning:KimiK3ReasoningParser")
