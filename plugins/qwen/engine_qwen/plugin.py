"""Hook implementations of engine-qwen. Imports nothing heavy."""

import engine


@engine.hookimpl
def register_models(register):
    register("Qwen3_5ForCausalLM", "engine_qwen.qwen3_5:Qwen3_5ForCausalLM")
    register("Qwen3_5MoeForCausalLM", "engine_qwen.qwen3_5:Qwen3_5MoeForCausalLM")
    register("Qwen3NextForCausalLM", "engine_qwen.qwen3_5:Qwen3NextForCausalLM")
    register("Qwen3_5ForConditionalGeneration", "engine_qwen.qwen3_5:Qwen3_5ForConditionalGeneration")
    register("Qwen3_5MoeForConditionalGeneration", "engine_qwen.qwen3_5:Qwen3_5MoeForConditionalGeneration")


@engine.hookimpl
def register_tool_parsers(register):
    register("qwen3_coder", "engine_qwen.parsers.qwen3_coder:Qwen3CoderToolParser")
