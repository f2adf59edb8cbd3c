"""DeepSeek-V4's manifold-constrained hyper-connections: the ``hc_mult`` residual streams
collapsed into each block's input, the block's output spread back over them
(``hyper_residual``), and ``hc_head``'s final collapse. All weights in float32.

The formulas are the package docstring's (``engine_deepseek_v4.deepseek_v4``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine_deepseek_v4.deepseek_v4.config import V4Dims
from engine_deepseek_v4.deepseek_v4.norms import unweighted_rms_norm


class HyperConnection(nn.Module):
    """One manifold-constrained hyper-connection: from the streams [T, n, hidden], the weights
    ``post`` [T, n] and ``comb`` [T, n, n] (float32) and the collapsed block input [T, hidden]."""

    def __init__(self, dims: V4Dims) -> None:
        super().__init__()
        n = self.n = dims.hc_mult
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * dims.hidden_size, dtype=torch.float32), requires_grad=False)
        self.base = nn.Parameter(torch.empty((2 + n) * n, dtype=torch.float32), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32), requires_grad=False)
        self.iters, self.eps, self.norm_eps = dims.hc_sinkhorn_iters, dims.hc_eps, dims.rms_norm_eps

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = self.n
        flat = unweighted_rms_norm(streams.reshape(streams.shape[0], -1).float(), self.norm_eps)
        pre_w, post_w, comb_w = F.linear(flat, self.fn).split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_scale, post_scale, comb_scale = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_scale + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * post_scale + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * comb_scale + comb_b.view(n, n), dim=-1) + self.eps
        # Sinkhorn-Knopp: columns, then rows and columns in turn
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed


def hyper_residual(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams: the block's output spread by ``post`` plus the old streams mixed by ``comb``ᵀ."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(1) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


class HyperHead(nn.Module):
    """The final collapse of the streams [T, n, hidden] -> [T, hidden]."""

    def __init__(self, dims: V4Dims) -> None:
        super().__init__()
        n = dims.hc_mult
        self.hc_fn = nn.Parameter(torch.empty(n, n * dims.hidden_size, dtype=torch.float32), requires_grad=False)
        self.hc_base = nn.Parameter(torch.empty(n, dtype=torch.float32), requires_grad=False)
        self.hc_scale = nn.Parameter(torch.empty(1, dtype=torch.float32), requires_grad=False)
        self.eps, self.norm_eps = dims.hc_eps, dims.rms_norm_eps

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = unweighted_rms_norm(streams.reshape(streams.shape[0], -1).float(), self.norm_eps)
        pre = torch.sigmoid(F.linear(flat, self.hc_fn) * self.hc_scale + self.hc_base) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
