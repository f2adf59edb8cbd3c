"""Kept for one minor version: the layer operations moved to ``engine.interfaces.ops``."""

from engine.interfaces.ops import REFERENCE_OPS, LayerOps

__all__ = ["REFERENCE_OPS", "LayerOps"]
