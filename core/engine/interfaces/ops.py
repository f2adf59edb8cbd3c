"""Elementwise layer operations (and greedy sampling's argmax) a platform may replace with fused kernels.

:class:`LayerOps` is the reference: plain torch, with the same roundings as HF
transformers' modules (each torch op on a bf16 tensor rounds its result to bf16).
A platform's ``layer_ops(dtype)`` may return a subclass whose methods fuse the
work; they must produce the same values up to the dtype's rounding. Models get
the resolved object through ``ForwardContext.ops``, chosen once at start-up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from engine.interfaces.group_quant import GroupQuantWeight


class LayerOps:
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """weight * normalise(x): x [..., H]; fp32 statistics, one rounding, then the scale."""
        return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """residual' = x + residual; returns (rms_norm(residual'), residual'). May reuse the inputs' memory."""
        residual = x + residual
        return self.rms_norm(residual, weight, eps), residual

    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate-half RoPE on the first ``cos.shape[-1]`` dims of every head.

        q: [T, H, D]; k: [T, Hkv, D]; cos, sin: [T, rotary_dim] in q's dtype. May work in place.
        """
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, 2d] holding gate then up -> silu(gate) * up: [T, d]."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
        """Structured output: in place, ``logits[rows[j], t] = -inf`` for every token ``t`` that
        ``bitmask[j]`` does not allow (bit ``t % 32`` of int32 word ``t // 32`` clear). logits:
        [N, V] float; bitmask: [M, >= ceil(V / 32)] int32; rows: [M] int64, distinct."""
        shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
        allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(bitmask.shape[0], -1)[:, : logits.shape[-1]]
        rows = rows.to(logits.device)
        logits[rows] = logits[rows].masked_fill(allowed.to(logits.device) == 0, float("-inf"))

    def group_quant_linear(
        self, x: torch.Tensor, weight: GroupQuantWeight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [T, K] times a group-quantized weight (``engine.interfaces.group_quant``'s layout),
        transposed, plus ``bias``: [T, N] in x's dtype. The reference sums in float32 the
        products of x with the float32 dequantized weight; a kernel must agree with it to
        float32 rounding of the sums (it may sum in any order). With 16-bit x a kernel may also
        round x to int8, as llama.cpp does, in blocks of at most 128 consecutive inputs of one
        group (the inputs after ``input_order``), each with the symmetric scale
        ``dx = max|x| / 127``: it may then differ from the reference by up to
        ``(dx / 2) @ |scales * q|^T`` more (the platform kit allows exactly that). The weight may
        be stored in 4, 6 or 8 bits a value and hold two-level scales (``super_group > 0``);
        a kernel that takes only float32 scales per group runs ``weight.one_level()`` (the same
        values)."""
        from engine.interfaces.group_quant import group_quant_linear

        return group_quant_linear(x, weight, bias)

    def fp8_linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        scales: torch.Tensor,
        block_k: int,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [T, K] times an FP8 weight, transposed, plus ``bias``: [T, N] in x's dtype. ``weight``
        is float8_e4m3fn [N, K] and ``scales`` float32 [N, ceil(K / block_k)]: element (n, k)
        stands for ``weight[n, k] * scales[n, k // block_k]``. The reference sums in float32 the
        products of x with that float32 weight (each product of an e4m3 value and a float32
        scale is exact in float32 unless it falls below float32's normal range); a kernel must
        agree with it to float32 rounding of the sums. With 16-bit x a kernel may also round the
        dequantized weight to x's dtype (a BLAS multiplying tiles of it): up to ``2^-8`` of
        ``|x| @ |W s|^T`` more (the platform kit allows exactly that)."""
        factors = scales.float().repeat_interleave(block_k, dim=1)[:, : weight.shape[1]]
        out = x.float() @ (weight.float() * factors).T
        if bias is not None:
            out = out + bias.float()
        return out.to(x.dtype)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [N, V] in any float dtype -> [N] int64, the first index of each row's
        maximum (a NaN counts as the maximum), as ``torch.argmax``. Greedy sampling."""
        return logits.argmax(dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rotary_dim = cos.shape[-1]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    out = rot * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)
    return out if rest.shape[-1] == 0 else torch.cat((out, rest), dim=-1)


REFERENCE_OPS = LayerOps()
