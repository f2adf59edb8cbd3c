"""Hook implementations of engine-llguidance. Imports nothing heavy."""

import engine


@engine.hookimpl
def register_structured_output_backends(register):
    register("llguidance", "engine_llguidance.backend:LLGuidanceBackend")
