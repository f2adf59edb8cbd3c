"""A GGUF layer's blocks cut for tensor-parallel ranks: each rank of a column-parallel layer
takes its outputs' rows of blocks (the last rank's padding rows zero), each rank of a
row-parallel one its inputs' blocks; the ranks' outputs, put together (concatenated, or
summed as the all-reduce would), are the whole layer's. Reference: ``F.linear`` on the
weight the ``gguf`` package dequantizes. Ranks are layers built with their rank's
``TensorParallel``, applied one after the other (no process group)."""

from __future__ import annotations

import gguf
import pytest
import torch

from engine.distributed.parallel_state import TensorParallel
from engine.layers.linear import ColumnParallelLinear, RowParallelLinear
from engine.layers.quantized_checkpoint import QUANTIZED_ATTR, QuantizedCheckpoint
from engine.model_loader.gguf import TYPE_TENSOR, GgufDequantizer
from engine.model_loader.gguf_quantize import quantize_blocks
from engine_gguf.quantizer import GgufQuantizer

INPUTS, OUTPUTS, RANKS = 512, 96, 2


def gguf_weight(kind: str, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks of ``weight`` as the engine hands a GGUF tensor on, and their dequantized values."""
    ggml_type = getattr(gguf.GGMLQuantizationType, kind)
    raw = torch.from_numpy(quantize_blocks(weight.numpy(), kind))
    setattr(
        raw,
        QUANTIZED_ATTR,
        QuantizedCheckpoint("w", "weight", TYPE_TENSOR, torch.tensor(int(ggml_type)), GgufDequantizer()),
    )
    return raw, torch.from_numpy(gguf.quants.dequantize(raw.numpy(), ggml_type))


def load(layer, raw: torch.Tensor, bias: torch.Tensor) -> None:
    layer.set_method(GgufQuantizer.from_config({"quant_method": "gguf"}, prequantized=True).get_linear_method("x"))
    layer.load_checkpoint_tensor("weight", 0, raw)
    assert layer.load_checkpoint_tensor("bias", 0, bias), layer.missing_tensors()
    layer.method.process_weights_after_loading(layer)


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q8_0"])
def test_column_and_row_parallel_ranks_add_up_to_the_layer(kind):
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(OUTPUTS, INPUTS, generator=gen), torch.randn(OUTPUTS, generator=gen)
    x = torch.randn(5, INPUTS, generator=gen)
    raw, dense = gguf_weight(kind, weight)
    want = torch.nn.functional.linear(x, dense, bias)
    columns, partial = [], torch.zeros_like(want)
    for rank in range(RANKS):
        tp = TensorParallel(rank=rank, size=RANKS)
        column = ColumnParallelLinear(INPUTS, [OUTPUTS], True, torch.float32, tp=tp)
        load(column, raw, bias)
        columns.append(column.method.apply(column, x))
        row = RowParallelLinear(INPUTS, OUTPUTS, True, torch.float32, tp=tp)
        load(row, raw, bias)
        start, length = row.in_slice
        partial += row.method.apply(row, x[:, start : start + length])  # the all-reduce's sum
    for got in (torch.cat(columns, dim=-1), partial):
        assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-5


def test_inputs_off_the_blocks_are_refused():
    raw, _ = gguf_weight("Q4_K", torch.randn(OUTPUTS, 768))
    row = RowParallelLinear(768, OUTPUTS, False, torch.float32, tp=TensorParallel(rank=1, size=2))
    row.set_method(GgufQuantizer.from_config({"quant_method": "gguf"}, prequantized=True).get_linear_method("x"))
    with pytest.raises(ValueError, match=r"inputs 384\.\.768 do not fall on the type's 256-input blocks"):
        row.load_checkpoint_tensor("weight", 0, raw)
