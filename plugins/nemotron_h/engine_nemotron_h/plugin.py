"""Hook implementations of engine-nemotron-h. Imports nothing heavy."""

import engine


@engine.hookimpl
def register_models(register):
    register("NemotronHForCausalLM", "engine_nemotron_h.nemotron_h:NemotronHForCausalLM")
