"""Shared by the server tests: the checkpoint they serve and small helpers."""

from __future__ import annotations

from pathlib import Path

API_KEY = "test-key-123"
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)
PLUGINS = ["cpu", "llama"]


def make_chat_checkpoint(path: Path) -> Path:
    """A tiny random Llama with a byte-level BPE tokenizer and a chat template; context 256."""
    from transformers import AutoTokenizer

    from engine.testing.checkpoints import make_tiny_checkpoint

    make_tiny_checkpoint("LlamaForCausalLM", path, with_tokenizer=True, max_position_embeddings=256)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


def engine_config(path: Path, **overrides):
    from engine.config import EngineConfig

    return EngineConfig(
        **{"model": str(path), "plugins": PLUGINS, "dtype": "float32", "kv_cache_memory": 0.02, **overrides}
    )


def free_blocks(server) -> int:
    return server.engine.call(lambda engine: engine.kv_manager.num_free_blocks).result(timeout=10)
