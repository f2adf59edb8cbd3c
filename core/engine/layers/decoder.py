"""Building blocks most decoder-only models share: the gated SiLU MLP, the pre-norm
decoder layer with its residual stream, the embedding + layers + norm stack (named as
HF checkpoints name them), and the loading of one checkpoint tensor into a linear layer
or a plain parameter.

The layers call their parts' ``forward`` directly rather than through ``nn.Module.__call__``:
a module call costs about a microsecond of Python, and a batch-1 decode step of an 8-layer
model made 85 of them. Forward hooks on the embedding, norms, projections and MLPs are
therefore not called; those on the ``Attention`` modules are (models call them as modules,
and the bench's attention timer hooks them)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from engine.distributed.parallel_state import TensorParallel
from engine.layers.layernorm import RMSNorm
from engine.layers.linear import (
    ColumnParallelLinear,
    MergedLinear,
    RowParallelLinear,
    VocabEmbedding,
    route_linear_tensor,
)
from engine.layers.quantized_checkpoint import dense_tensor

if TYPE_CHECKING:
    from engine.interfaces.forward_context import ForwardContext

# checkpoint module name -> (fused module name, shard index), for a gated MLP's projections
GATE_UP_PARAMS = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def require_silu(config, model: nn.Module) -> None:
    """The gated MLPs here compute SiLU: refuse a config that names another activation."""
    activation = config.get("hidden_act", "silu")
    if activation != "silu":
        raise ValueError(f"{type(model).__name__} supports hidden_act 'silu' only, config has {activation!r}.")


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one layer; under tensor
    parallelism (``tp``) each rank holds a part of the intermediate size (gate/up by rows,
    down by columns) and the ranks sum their outputs."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool,
        dtype: torch.dtype,
        *,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias, dtype, what="intermediate_size", tp=tp
        )
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, dtype, what="intermediate_size", tp=tp)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        # a long prefill runs MLP_ROWS rows at a time, so that the gate/up output each down
        # projection reads is still in cache (every row's result is the same either way)
        if x.shape[0] <= MLP_ROWS:
            return self.down_proj.forward(self.gate_up_proj.forward_silu_and_mul(x, ctx.ops))
        out = torch.empty(x.shape[0], sum(self.down_proj.output_sizes), dtype=x.dtype, device=x.device)
        for start in range(0, x.shape[0], MLP_ROWS):
            rows = x[start : start + MLP_ROWS]
            out[start : start + MLP_ROWS] = self.down_proj.forward(
                self.gate_up_proj.forward_silu_and_mul(rows, ctx.ops)
            )
        return out


MLP_ROWS = 2048  # rows of the MLP at a time: a long prefill's [rows, 2 x intermediate] stays in cache


class PreNormDecoderLayer(nn.Module):
    """``self_attn(h, ctx, cos_sin)`` and ``mlp(h, ctx)``, each after an RMSNorm, on a
    residual stream: ``residual`` holds the sum so far and ``h`` the layer's input before
    its norm, so each norm can fuse the residual add (``ops.add_rms_norm``)."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden_size, eps, dtype)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, dtype)

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: ForwardContext,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """With ``rows`` (a last layer, ``ForwardContext.output_rows``) the attention runs for
        every token, which writes their keys and values, and the MLP for those rows alone."""
        if residual is None:
            residual, h = h, self.input_layernorm.forward(h, ops=ctx.ops)
        else:
            h, residual = self.input_layernorm.forward(h, residual, ops=ctx.ops)
        h = self.self_attn.forward(h, ctx, cos_sin)
        if rows is not None:
            h, residual = h.index_select(0, rows), residual.index_select(0, rows)
        h, residual = self.post_attention_layernorm.forward(h, residual, ops=ctx.ops)
        return self.mlp.forward(h, ctx), residual


class DecoderStack(nn.Module):
    """``embed_tokens`` (split over the vocabulary under ``tp``), ``layers`` and the final ``norm``."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        eps: float,
        layers: list[nn.Module],
        dtype: torch.dtype,
        *,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(vocab_size, hidden_size, dtype, tp=tp)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hidden_size, eps, dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        ctx: ForwardContext,
        cos_sin: Callable[[torch.dtype], tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """input_ids [T] -> final hidden states [T, hidden], or of ``ctx.output_rows`` alone where
        the last layer is a PreNormDecoderLayer (which then runs its MLP on those rows only);
        ``cos_sin(dtype)`` gives the step's rope table."""
        h = self.embed_tokens.forward(input_ids)
        table = cos_sin(h.dtype)
        residual = None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            if i == last and ctx.output_rows is not None and isinstance(layer, PreNormDecoderLayer):
                h, residual = layer.forward(h, residual, ctx, table, ctx.output_rows)
            else:
                h, residual = layer.forward(h, residual, ctx, table)
        h, _ = self.norm.forward(h, residual, ops=ctx.ops)
        return h


def load_tensor(
    owner: nn.Module,
    params: dict[str, nn.Parameter],
    linears: dict[str, MergedLinear],
    name: str,
    tensor: torch.Tensor,
    stacked: dict[str, tuple[str, int]],
) -> set[str]:
    """Put one checkpoint tensor in place: into its (possibly fused, possibly quantized)
    linear layer, else into the parameter of that name. Returns the parameter names now
    complete (a linear layer's once all its tensors arrived). A tensor with no place is a
    ``KeyError`` naming ``owner``'s class; a shape mismatch a ``ValueError``."""
    routed = route_linear_tensor(linears, name, stacked)
    if routed is not None:
        path, shard, tensor_name = routed
        if linears[path].load_checkpoint_tensor(tensor_name, shard, tensor):
            return {f"{path}.{p}" for p, _ in linears[path].named_parameters()}
        return set()
    param = params.get(name)
    if param is None:
        raise KeyError(f"Checkpoint tensor {name!r} has no place in {type(owner).__name__}.")
    return load_parameter(param, name, tensor)


def load_parameter(param: nn.Parameter, name: str, tensor: torch.Tensor) -> set[str]:
    """Copy a checkpoint tensor into a parameter, or hand it to the parameter's own
    ``load_checkpoint(name, tensor)`` (a tensor-parallel part takes its rows of it)."""
    tensor = dense_tensor(name, tensor, param.dtype)
    loader = getattr(param, "load_checkpoint", None)
    if loader is not None:
        loader(name, tensor)
        return {name}
    if param.shape != tensor.shape:
        raise ValueError(f"{name}: model expects shape {tuple(param.shape)}, checkpoint has {tuple(tensor.shape)}.")
    param.data.copy_(tensor)
    return {name}
