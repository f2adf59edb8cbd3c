"""Fixtures of the server tests: a live server on 127.0.0.1 over a tiny random
Llama with a tokenizer and a chat template, and the offline ``LLM`` on the same
checkpoint as the reference."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))
from server_helpers import API_KEY, PLUGINS, engine_config, make_chat_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def chat_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chat_checkpoint(tmp_path_factory.mktemp("chat-llama"))


@pytest.fixture(scope="module")
def server(chat_checkpoint: Path):
    from engine.config import ServerConfig
    from engine.entrypoints.serve import start_server

    running = start_server(
        engine_config(chat_checkpoint), ServerConfig(port=0, api_key=API_KEY, served_model_name="tiny")
    )
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    import openai

    with openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def offline(chat_checkpoint: Path):
    from engine.llm import LLM

    return LLM(str(chat_checkpoint), plugins=PLUGINS, dtype="float32", kv_cache_memory=0.02, progress=False)
