"""The Llama, Mistral and Qwen families' tool-call formats and Qwen3's reasoning markers."""

from engine_llama.parsers.hermes import HermesToolParser
from engine_llama.parsers.llama3_json import Llama3JsonToolParser
from engine_llama.parsers.mistral import MistralToolParser
from engine_llama.parsers.qwen3 import Qwen3ReasoningParser

__all__ = ["HermesToolParser", "Llama3JsonToolParser", "MistralToolParser", "Qwen3ReasoningParser"]
