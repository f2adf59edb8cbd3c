"""The xgrammar backend through the engine's conformance kit."""

from engine.testing.kit import StructuredOutputBackendTests


class TestXGrammarKit(StructuredOutputBackendTests):
    plugin = "xgrammar"
    backend_name = "xgrammar"
