"""Hook implementations of engine-qwen. Imports nothing heavy."""

import engine


@engine.hookimpl
def register_models(register):
    register("Qwen3_5ForCausalLM", "engine_qwen.qwen3_5:Qwen3_5ForCausalLM")
    register("Qwen3_5MoeForCausalLM", "engine_qwen.qwen3_5:Qwen3_5MoeForCausalLM")
    register("Qwen3NextForCausalLM", "engine_qwen.qwen3_5:Qwen3NextForCausalLM")
    register("Qwen3_5ForConditionalGeneration", "engine_qwen.qwen3_5:Qwen3_5ForConditionalGeneration")
    register("Qwen3_5MoeForConditionalGeneration", "engine_qwen.qwen3_5:Qwen3_5MoeForConditionalGeneration")
    # the multi-token-prediction blocks the engine's mtp proposer drafts with (engine.spec_decode.mtp)
    register("Qwen3_5ForCausalLM.mtp", "engine_qwen.mtp:Qwen3_5Mtp")
    register("Qwen3_5MoeForCausalLM.mtp", "engine_qwen.mtp:Qwen3_5MoeMtp")
    register("Qwen3NextForCausalLM.mtp", "engine_qwen.mtp:Qwen3NextMtp")
    register("Qwen3_5ForConditionalGeneration.mtp", "engine_qwen.mtp:Qwen3_5MultimodalMtp")
    register("Qwen3_5MoeForConditionalGeneration.mtp", "engine_qwen.mtp:Qwen3_5MoeMultimodalMtp")


@engine.hookimpl
def register_tool_parsers(register):
    register("qwen3_coder", "engine_qwen.parsers.qwen3_coder:Qwen3CoderToolParser")
