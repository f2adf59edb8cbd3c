"""Kept for one minor version: the engine moved to ``engine.engine.llm_engine``, and
``build_model`` / ``build_kv_cache`` to ``engine.runtime.model_builder``."""

from __future__ import annotations

from engine.engine.llm_engine import LLMEngine, StepResult
from engine.runtime.model_builder import build_kv_cache, build_model

__all__ = ["LLMEngine", "StepResult", "build_kv_cache", "build_model"]
