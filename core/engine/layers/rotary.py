"""Rotary position embeddings (neox / rotate-half layout) with HF's rope_type variants."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from engine.interfaces.ops import REFERENCE_OPS, LayerOps
from engine.model_config import HFConfig


def rope_parameters(config: HFConfig) -> dict[str, Any]:
    """Normalise ``rope_parameters`` (transformers 5) and ``rope_theta`` /
    ``rope_scaling`` (older configs) into one dict with ``rope_type`` and ``rope_theta``."""
    params: dict[str, Any] = {}
    scaling = config.get("rope_scaling")
    if scaling is not None:
        params.update(scaling.to_dict())
    new = config.get("rope_parameters")
    if new is not None:
        params.update(new.to_dict())
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    params["rope_type"] = rope_type
    return params


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature factor for a context extended ``scale`` times."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inverse_frequencies(
    rotary_dim: int, params: dict[str, Any], max_positions: int | None = None
) -> tuple[torch.Tensor, float]:
    """inv_freq [rotary_dim // 2] in fp32 and the cos/sin scaling factor. ``max_positions``
    (the model's ``max_position_embeddings``) gives YaRN's factor when the config has none."""
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if rope_type == "llama3":
        factor = float(params["factor"])
        low_freq_factor = float(params["low_freq_factor"])
        high_freq_factor = float(params["high_freq_factor"])
        old_context_len = float(params["original_max_position_embeddings"])
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # long wavelengths are divided by factor, short ones kept, the middle band interpolated
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled), 1.0
    if rope_type == "yarn":
        return _yarn(inv_freq, rotary_dim, base, params, max_positions)
    if rope_type == "longrope":
        raise ValueError(
            "rope_type 'longrope' turns positions before and after original_max_position_embeddings at different "
            "frequencies: build its table with RotaryEmbedding (or longrope_angles), not from one inv_freq."
        )
    raise ValueError(f"Unsupported rope_type {rope_type!r}. Supported: default, linear, llama3, yarn, longrope.")


def longrope_angles(rotary_dim: int, params: dict[str, Any], max_positions: int) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3, arXiv 2402.13753): the angles [max_positions, rotary_dim // 2] in fp32 and
    the cos/sin scaling factor. Each frequency is divided by its ``short_factor`` at positions
    before ``original_max_position_embeddings`` and by its ``long_factor`` from there on, so a
    position always turns the same way, whatever the length of its sequence, and cached keys
    stay valid. That is transformers' forward through its cache as a sequence grows one token at
    a time; one transformers forward over a sequence longer than the original context (and its
    ``generate``, which recomputes the sequence as it passes that length) turns every position by
    ``long_factor`` instead. The scaling factor is ``attention_factor``, else
    ``sqrt(1 + ln(factor) / ln(original))`` with ``factor`` defaulting to ``max_positions / original``."""
    original = int(params["original_max_position_embeddings"])
    factor = float(params.get("factor") or max_positions / original)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    base = float(params["rope_theta"])
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    positions = torch.arange(max_positions, dtype=torch.float32)
    angles = []
    for key, rows in (("short_factor", positions[:original]), ("long_factor", positions[original:])):
        factors = torch.tensor(params[key], dtype=torch.float32)
        if factors.shape != exponents.shape:
            raise ValueError(
                f"rope {key} has {factors.numel()} entries, the rotary dimensions need {exponents.numel()} "
                f"(rotary_dim {rotary_dim} / 2): check rope_parameters and partial_rotary_factor."
            )
        angles.append(torch.outer(rows, 1.0 / (factors * base**exponents)))
    return torch.cat(angles), float(attention_factor)


def _yarn(
    inv_freq: torch.Tensor, dim: int, base: float, params: dict[str, Any], max_positions: int | None
) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071) as transformers computes it: frequencies below the correction
    range are interpolated by ``factor``, those above kept, a linear ramp between."""
    original = float(params["original_max_position_embeddings"])
    factor = params.get("factor")
    if factor is None:
        if max_positions is None:
            raise ValueError("YaRN rope_parameters without 'factor' need the model's max_position_embeddings.")
        factor = max_positions / original
    factor = float(factor)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # share of each frequency kept as it is
    return inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k by position, from a cos/sin table built once in fp32."""

    def __init__(
        self, head_size: int, max_positions: int, params: dict[str, Any], rotary_dim: int | None = None
    ) -> None:
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = rotary_dim or head_size
        if params["rope_type"] == "longrope":
            freqs, attention_scaling = longrope_angles(self.rotary_dim, params, max_positions)
        else:
            inv_freq, attention_scaling = inverse_frequencies(self.rotary_dim, params, max_positions)
            freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        # cos, sin: [max_positions, rotary_dim]
        self.register_buffer("cos", emb.cos() * attention_scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * attention_scaling, persistent=False)
        self.max_positions = max_positions
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for ``positions`` [T]: [T, rotary_dim] each, in ``dtype``; gather once per step."""
        _, cos, sin = self._tables_in(dtype)
        return cos.index_select(0, positions), sin.index_select(0, positions)

    def _tables_in(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the fp32 cos buffer they were made from, cos, sin) in ``dtype``: converted once, not
        every step (rounding then gathering gives the same rows as gathering then rounding), and
        again after the buffers were replaced (``module.to(...)``)."""
        tables = self._tables.get(dtype)
        if tables is None or tables[0] is not self.cos:
            tables = self._tables[dtype] = (self.cos, self.cos.to(dtype), self.sin.to(dtype))
        return tables

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, ops: LayerOps = REFERENCE_OPS
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.rotary(q, k, *self.cos_sin(positions, q.dtype))
