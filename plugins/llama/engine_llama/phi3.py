"""Phi-3 (and Phi-3.5-mini, Phi-4, Phi-4-mini): Mistral's network with q/k/v and gate/up stored
fused in the checkpoint (``qkv_proj``, ``gate_up_proj``), RoPE on the first
``partial_rotary_factor`` of each head, LongRoPE (``rope_type`` ``longrope``, formerly ``su``)
for the long-context checkpoints, and an optional sliding window on every layer."""

from __future__ import annotations

from typing import Any, Iterable

import torch

from engine.model_config import HFConfig

from .model import Dims, LlamaForCausalLM, Variant

# the fused checkpoint tensors, split back into the parts the fused layers load
FUSED_QKV, FUSED_GATE_UP = "self_attn.qkv_proj.", "mlp.gate_up_proj."


class Phi3ForCausalLM(LlamaForCausalLM):
    variant = Variant(qkv_bias=False, o_bias=False, sliding_window="all")

    def rope_parameters(self, config: HFConfig) -> dict[str, Any]:
        """Configs written before transformers named it say ``su`` (or ``yarn``) for LongRoPE, and
        keep ``original_max_position_embeddings`` beside the rope parameters."""
        params = super().rope_parameters(config)
        if params["rope_type"] in ("su", "yarn"):
            params["rope_type"] = "longrope"
        if params["rope_type"] == "longrope" and "original_max_position_embeddings" not in params:
            original = config.get("original_max_position_embeddings")
            if original is None:
                raise ValueError(
                    f"{type(self).__name__}: rope_type 'longrope' needs original_max_position_embeddings (the "
                    f"pre-training context, where long_factor takes over), and the config has none."
                )
            params["original_max_position_embeddings"] = int(original)
        return params

    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """``qkv_proj`` rows are q, k then v; ``gate_up_proj`` rows gate then up: each is split
        into its parts, which the fused layers take as they take separate checkpoints' (so
        tensor-parallel ranks cut each part)."""
        dims: Dims = self.dims
        qkv_rows = [
            dims.num_heads * dims.head_dim,
            dims.num_kv_heads * dims.head_dim,
            dims.num_kv_heads * dims.head_dim,
        ]
        for name, tensor in super().checkpoint_tensors(weights):
            prefix, fused, suffix = _split_name(name)
            if fused == FUSED_QKV:
                parts, names = _rows(name, tensor, qkv_rows), ("q_proj", "k_proj", "v_proj")
                yield from ((f"{prefix}self_attn.{n}.{suffix}", part) for n, part in zip(names, parts))
            elif fused == FUSED_GATE_UP:
                parts = _rows(name, tensor, [dims.intermediate_size] * 2)
                yield from ((f"{prefix}mlp.{n}.{suffix}", part) for n, part in zip(("gate_proj", "up_proj"), parts))
            else:
                yield name, tensor


def _split_name(name: str) -> tuple[str, str | None, str]:
    """``model.layers.3.self_attn.qkv_proj.weight`` -> (``model.layers.3.``, ``self_attn.qkv_proj.``,
    ``weight``); names of no fused tensor give (name, None, "")."""
    for fused in (FUSED_QKV, FUSED_GATE_UP):
        prefix, found, suffix = name.partition(fused)
        if found and prefix.endswith(".") and suffix in ("weight", "bias"):
            return prefix, fused, suffix
    return name, None, ""


def _rows(name: str, tensor: torch.Tensor, rows: list[int]) -> tuple[torch.Tensor, ...]:
    if tensor.shape[0] != sum(rows):
        raise ValueError(
            f"{name}: model expects {sum(rows)} rows ({' + '.join(map(str, rows))}), checkpoint has {tensor.shape[0]}."
        )
    return tensor.split(rows, dim=0)
