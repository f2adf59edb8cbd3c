"""The xgrammar tests' fixtures; they import their shared helpers (xgrammar_helpers.py) from
this folder."""

import sys
from pathlib import Path

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))

import pytest  # noqa: E402
from xgrammar_helpers import Walker, build_backend  # noqa: E402

from engine.testing.checkpoints import make_tiny_tokenizer  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer():
    return make_tiny_tokenizer(512)


@pytest.fixture(scope="session")
def backend(tokenizer):
    backend = build_backend(tokenizer)
    yield backend
    backend.close()


@pytest.fixture(scope="session")
def walker(backend, tokenizer):
    return Walker(backend, tokenizer)
