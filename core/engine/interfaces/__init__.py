"""The extension interfaces. Import the submodule you implement, e.g.
``from engine.interfaces.attention import AttentionBackend``; ``model`` and
``attention`` import torch, the others do not."""
