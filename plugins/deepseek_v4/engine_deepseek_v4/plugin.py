"""Hook implementations of engine-deepseek-v4. Imports nothing heavy."""

import engine


@engine.hookimpl
def register_models(register):
    register("DeepseekV3ForCausalLM", "engine_deepseek_v4.deepseek_v3:DeepseekV3ForCausalLM")
    register("DeepseekV32ForCausalLM", "engine_deepseek_v4.deepseek_v3:DeepseekV32ForCausalLM")
    register("DeepseekV4ForCausalLM", "engine_deepseek_v4.deepseek_v4:DeepseekV4ForCausalLM")


@engine.hookimpl
def register_spec_proposers(register):
    register("mtp", "engine_deepseek_v4.mtp:MtpProposer")
