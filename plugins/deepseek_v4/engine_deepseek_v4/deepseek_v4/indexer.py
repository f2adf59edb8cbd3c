"""DeepSeek-V4's lightning indexer: in a compressed sparse attention layer, scores the
finished compressed entries for each query and keeps the ``index_topk`` best. Its keys are
pooled by a compressor of its own (at ``index_head_dim``), which it extends.

V3.2's indexer (``engine_deepseek_v4.deepseek_v3.Indexer``) is a different network: it
scores every position's own key through an attention backend, where this one scores
pooled keys in the model."""

from __future__ import annotations

import torch
from torch import nn

from engine.interfaces.forward_context import ForwardContext
from engine.layers.linear import Linear
from engine_deepseek_v4.deepseek_v4.compressor import Compressor
from engine_deepseek_v4.deepseek_v4.config import V4Dims
from engine_deepseek_v4.deepseek_v4.rope import Rope, rotate


class LightningIndexer(Compressor):
    """Picks the ``index_topk`` compressed entries each query attends to in a compressed sparse
    layer: ``Σ_h w_h · relu(q_h·k_w) / √index_head_dim`` over keys ``k_w`` pooled as the
    entries are (its own compressor at ``index_head_dim``, overlapping windows), those
    finished by the query's position, kept at their windows' last slots in token-state
    layer ``keys_layer``."""

    def __init__(self, dims: V4Dims, ratio: int, state_layer: int, keys_layer: int, dtype: torch.dtype) -> None:
        super().__init__(dims, ratio, dims.index_head_dim, True, state_layer, dtype)
        self.q_b_proj = Linear(dims.q_lora_rank, dims.index_n_heads * dims.index_head_dim, False, dtype)
        self.scorer = nn.Module()
        self.scorer.weights_proj = Linear(dims.hidden_size, dims.index_n_heads, False, dtype)
        self.dims, self.keys_layer = dims, keys_layer

    def select(
        self,
        x: torch.Tensor,
        q_latent: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        rope: Rope,
        rope_q: tuple[torch.Tensor, torch.Tensor],
        finished: torch.Tensor,
    ) -> torch.Tensor:
        """[T, k]: positions (window ends) of each query's chosen entries, -1 padded. ``finished``:
        [T, n_max] the window ends the step's queries may see (-1 where not yet)."""
        d = self.dims
        ctx.store(self.keys_layer, self(x, positions, ctx, rope))
        keys = ctx.gather(self.keys_layer, finished).float()  # [T, n_max, index_head_dim]
        q = self.q_b_proj(q_latent).view(x.shape[0], d.index_n_heads, d.index_head_dim)
        q = rotate(q, *rope_q)
        scores = torch.einsum("thd,tnd->thn", q.float(), keys).relu_() * d.index_head_dim**-0.5
        weights = self.scorer.weights_proj(x).float() * d.index_n_heads**-0.5  # [T, heads]
        total = torch.einsum("thn,th->tn", scores, weights).masked_fill_(finished < 0, float("-inf"))
        best, chosen = total.topk(min(d.index_topk, total.shape[1]), dim=-1)
        return finished.gather(1, chosen).masked_fill_(best == float("-inf"), -1)
