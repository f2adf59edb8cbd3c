"""Kept for one minor version: ``ForwardContext`` moved to ``engine.interfaces.forward_context``."""

from engine.interfaces.forward_context import ForwardContext

__all__ = ["ForwardContext"]
