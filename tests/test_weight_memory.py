"""The weights a loaded model holds, as the engine logs them once loading ends
("weights: X MiB resident (Y MiB in N quantized linear layers, Z% of their float32 size)"),
against a count by hand from the tiny Llama's config: unquantized, and quantized to 4-bit
GPTQ while loading, which engine-gptq holds in the engine's group-quantized layout
(core/engine/interfaces/group_quant.py: uint8 values two to a byte, a float32 scale and
offset per output row and group of inputs)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from engine import LLM
from engine.runtime.model_builder import weight_memory
from engine.testing.checkpoints import TINY_CONFIGS

PLUGINS = ["cpu", "llama", "gptq"]
GROUP_SIZE = 32
MIB = 2**20

C = TINY_CONFIGS["LlamaForCausalLM"]
H, INTER, V, L = C["hidden_size"], C["intermediate_size"], C["vocab_size"], C["num_hidden_layers"]
HEAD_DIM = H // C["num_attention_heads"]
Q, KV = C["num_attention_heads"] * HEAD_DIM, C["num_key_value_heads"] * HEAD_DIM
# each decoder layer's linear layers as the engine fuses them: (outputs, inputs)
LINEAR = {"qkv_proj": (Q + 2 * KV, H), "o_proj": (H, Q), "gate_up_proj": (2 * INTER, H), "down_proj": (H, INTER)}


def hand_count(itemsize: int, quantized: bool) -> tuple[int, int, int]:
    """(resident bytes, bytes of the quantized layers, their bytes dense) of the tiny Llama in
    a compute dtype of ``itemsize`` bytes: embedding and LM head (untied), two RMSNorms a layer
    and a final one, the four linear layers of each layer, and the rotary cos and sin tables
    (float32 [max_position_embeddings, head_dim] each, whatever the compute dtype)."""
    dense_linear = L * sum(n * k for n, k in LINEAR.values()) * itemsize
    # 4-bit symmetric: N * K / 2 bytes of values, a float32 scale per row and group of 32 inputs
    # (each offset is the zero, 8, times the scale: no tensor of offsets)
    gptq_linear = L * sum(n * k // 2 + n * (k // GROUP_SIZE) * 4 for n, k in LINEAR.values())
    others = (2 * V * H + (2 * L + 1) * H) * itemsize + 2 * C["max_position_embeddings"] * HEAD_DIM * 4
    if not quantized:
        return others + dense_linear, 0, 0
    return others + gptq_linear, gptq_linear, dense_linear


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from engine.testing.checkpoints import make_tiny_checkpoint

    path = tmp_path_factory.mktemp("weights") / "tiny-llama"
    make_tiny_checkpoint("LlamaForCausalLM", path)
    return str(path)


def load(path: str, **kwargs) -> LLM:
    return LLM(path, plugins=PLUGINS, dtype="float32", progress=False, kv_cache_memory=0.01, **kwargs)


def test_unquantized_weights_are_every_parameter_and_buffer(tiny_llama, caplog):
    with caplog.at_level(logging.INFO, logger="engine"):
        memory = load(tiny_llama).engine.model.weight_memory
    resident, _, _ = hand_count(4, quantized=False)
    assert memory.resident_bytes == resident
    assert (memory.quantized_bytes, memory.quantized_dense_bytes, memory.num_quantized_layers) == (0, 0, 0)
    assert memory.quantized_fraction is None
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("weights")]
    assert logged == [f"weights: {resident / MIB:.2f} MiB resident (no quantized linear layers)"]


def test_gptq_while_loading_counts_the_packed_layers_against_their_dense_size(tiny_llama, caplog):
    with caplog.at_level(logging.INFO, logger="engine"):
        llm = load(tiny_llama, quantization="gptq", quantization_config={"bits": 4, "group_size": GROUP_SIZE})
    memory = llm.engine.model.weight_memory
    resident, quantized, dense = hand_count(4, quantized=True)
    assert memory.resident_bytes == resident
    assert memory.quantized_bytes == quantized and memory.quantized_dense_bytes == dense
    assert memory.num_quantized_layers == L * len(LINEAR)  # the LM head stays dense
    # float32 weights: 4 bits of 32 plus 32 bits of scale per 32 weights, 5/32 of them
    assert memory.quantized_fraction == pytest.approx(5 / 32)
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("weights")]
    assert logged == [
        f"weights: {resident / MIB:.2f} MiB resident ({quantized / MIB:.2f} MiB in {L * len(LINEAR)} quantized "
        "linear layers, 15.6% of their float32 size)"
    ]


class Packed(nn.Module):
    """A layer with a parameter, a buffer, a packed copy kept as a plain attribute, and an
    alias of the parameter's storage (counted once)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(8, 4), requires_grad=False)  # 128 bytes
        self.register_buffer("table", torch.zeros(16, dtype=torch.float64))  # 128 bytes
        self.packed = torch.zeros(4, 8, dtype=torch.bfloat16)  # 64 bytes
        self.alias = self.weight.data[2:]  # the parameter's storage again
        self.empty = torch.empty(0)


def test_tensors_outside_parameters_count_and_shared_storage_counts_once():
    model = nn.Sequential(Packed(), Packed())
    model[1].weight = model[0].weight  # tied: the second layer's own weight is gone
    model[1].alias = model[0].weight.data[2:]
    memory = weight_memory(model, [])
    assert memory.resident_bytes == 128 + 2 * (128 + 64)
