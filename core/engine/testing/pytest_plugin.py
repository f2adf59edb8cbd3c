"""pytest plugin of engine (entry point ``pytest11``): passive fixtures only.

- ``tiny_checkpoint``: factory ``tiny_checkpoint(architecture, **overrides) ->
  (path, hf_model)`` saving a random-weight checkpoint in a fresh temp folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest


@pytest.fixture
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., tuple[Path, Any]]:
    from engine.testing.checkpoints import make_tiny_checkpoint

    def make(architecture: str, **overrides: Any) -> tuple[Path, Any]:
        path = tmp_path_factory.mktemp(architecture)
        return path, make_tiny_checkpoint(architecture, path, **overrides)

    return make
