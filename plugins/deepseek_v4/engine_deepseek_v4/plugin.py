"""Hook implementations of engine-deepseek-v4: the three models and their multi-token-prediction
blocks (``"<Architecture>.mtp"``, which the engine's ``mtp`` proposer drafts with), the family's
tool-call parsers and its reasoning parser. Imports nothing heavy."""

import engine


@engine.hookimpl
def register_models(register):
    register("DeepseekV3ForCausalLM", "engine_deepseek_v4.deepseek_v3:DeepseekV3ForCausalLM")
    register("DeepseekV32ForCausalLM", "engine_deepseek_v4.deepseek_v3:DeepseekV32ForCausalLM")
    register("DeepseekV4ForCausalLM", "engine_deepseek_v4.deepseek_v4:DeepseekV4ForCausalLM")
    # the blocks the engine's mtp proposer drafts with (engine.spec_decode.mtp)
    register("DeepseekV3ForCausalLM.mtp", "engine_deepseek_v4.mtp:MtpLayer")
    register("DeepseekV32ForCausalLM.mtp", "engine_deepseek_v4.mtp:MtpLayer")
    register("DeepseekV4ForCausalLM.mtp", "engine_deepseek_v4.mtp:MtpV4Module")


@engine.hookimpl
def register_tool_parsers(register):
    register("deepseek_v3", "engine_deepseek_v4.parsers.deepseek_v3:DeepSeekV3ToolParser")
    register("deepseek_v31", "engine_deepseek_v4.parsers.deepseek_v3:DeepSeekV31ToolParser")
    register("deepseek_v32", "engine_deepseek_v4.parsers.dsml:DeepSeekV32ToolParser")
    register("deepseek_v4", "engine_deepseek_v4.parsers.dsml:DeepSeekV4ToolParser")


@engine.hookimpl
def register_reasoning_parsers(register):
    register("deepseek_r1", "engine_deepseek_v4.parsers.reasoning:DeepSeekR1ReasoningParser")
