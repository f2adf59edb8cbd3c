"""The llguidance backend through the engine's conformance kit."""

from engine.testing.kit import StructuredOutputBackendTests


class TestLLGuidanceKit(StructuredOutputBackendTests):
    plugin = "llguidance"
    backend_name = "llguidance"
