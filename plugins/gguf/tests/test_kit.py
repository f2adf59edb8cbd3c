"""engine-gguf through the conformance kit: each GGUF type quantized while loading (by
round-to-nearest into the blocks a GGUF file holds) and exported as a file's tensors."""

from engine.testing.kit import QuantizerTests


class TestGguf(QuantizerTests):
    plugin = "gguf"
    quantizer_name = "gguf"
    configs = {kind: {"type": kind} for kind in ("Q8_0", "Q6_K", "Q5_K", "Q4_K", "Q4_0")}
