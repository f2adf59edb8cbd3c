"""Hook implementations of engine-xgrammar. Imports nothing heavy."""

import engine


@engine.hookimpl
def register_structured_output_backends(register):
    register("xgrammar", "engine_xgrammar.backend:XGrammarBackend")
