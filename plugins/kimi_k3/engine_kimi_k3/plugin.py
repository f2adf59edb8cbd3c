"""Hook implementations of engine-kimi-k3. Imports nothing heavy."""

import engine


@engine.hookimpl
def register_models(register):
    register("KimiLinearForCausalLM", "engine_kimi_k3.kimi_linear:KimiLinearForCausalLM")
    register("KimiK3ForConditionalGeneration", "engine_kimi_k3.kimi_k3:KimiK3ForConditionalGeneration")
