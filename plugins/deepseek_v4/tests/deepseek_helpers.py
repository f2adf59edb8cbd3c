"""What the DeepSeek tests share: the engine on a tiny checkpoint, random prompts, greedy output."""

from __future__ import annotations

from engine import LLM
from engine.testing.generation import greedy_tokens as greedy
from engine.testing.generation import random_prompts as prompts

__all__ = ["PLUGINS", "greedy", "make_llm", "prompts"]

PLUGINS = ["cpu", "deepseek_v4"]


def make_llm(path, **kwargs) -> LLM:
    """The engine on the checkpoint at ``path``, in fp32, with a small KV cache."""
    return LLM(
        str(path), **{"plugins": PLUGINS, "dtype": "float32", "kv_cache_memory": 0.05, "progress": False, **kwargs}
    )
