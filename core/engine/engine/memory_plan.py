"""KV-cache sizing by ``--gpu-memory-utilization`` on platforms whose allocator counts its
bytes (:meth:`Platform.memory_stats`: cuda, rocm, xpu), as vLLM sizes it.

The engine may take ``utilization`` of the device's total memory. Before the KV cache exists,
what is in use (the weights, the runtime's own memory, other processes) is read from the
device's free memory, and a profiling forward at ``max_num_batched_tokens`` tokens (prompts
from position 0 in sequences of at most ``max_model_len``, then the LM head on
``max_num_seqs`` rows) measures the activations' peak above the weights. The KV cache gets
the rest::

    kv = total * utilization - (total - free) - activation peak

Each figure is logged; a budget of nothing is an error that names them and what to change.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.interfaces.model import Model

logger = logging.getLogger("engine")
GiB = 2**30


@dataclass(frozen=True)
class MemoryBudget:
    total_bytes: int
    utilization: float
    in_use_bytes: int  # before the KV cache: weights, the runtime, other processes
    activation_peak_bytes: int  # the profiling forward's peak above what was allocated before it
    profile_tokens: int

    @property
    def kv_cache_bytes(self) -> int:
        return int(self.total_bytes * self.utilization) - self.in_use_bytes - self.activation_peak_bytes

    def describe(self) -> str:
        return (
            f"{self.total_bytes / GiB:.2f} GiB total x gpu_memory_utilization {self.utilization:g} = "
            f"{self.total_bytes * self.utilization / GiB:.2f} GiB; in use before the KV cache (weights, runtime, "
            f"other processes) {self.in_use_bytes / GiB:.2f} GiB; activation peak of a forward at "
            f"{self.profile_tokens} tokens {self.activation_peak_bytes / GiB:.2f} GiB; KV cache "
            f"{self.kv_cache_bytes / GiB:.2f} GiB"
        )


def budget_kv_cache(budget: MemoryBudget) -> int:
    """The KV cache's bytes, logged with how they were reached; none left is a ValueError."""
    if budget.kv_cache_bytes <= 0:
        raise ValueError(
            f"No device memory is left for the KV cache: {budget.describe()}. Raise --gpu-memory-utilization, "
            f"lower --max-num-batched-tokens (the profiled forward's size), free the device of other processes, "
            f"or set --kv-cache-memory."
        )
    logger.info("KV-cache memory: %s", budget.describe())
    return budget.kv_cache_bytes


def profile_sequences(num_tokens: int, max_model_len: int) -> list[int]:
    """The prompt lengths of the profiling forward: ``num_tokens`` in sequences of at most
    ``max_model_len`` (the last one shorter)."""
    full, rest = divmod(num_tokens, max_model_len)
    return [max_model_len] * full + ([rest] if rest else [])


def profile_arrays(lengths: list[int], block_size: int, recurrent: bool) -> dict:
    """The runner's host arrays of a step that prefills sequences of ``lengths`` (token 0) from
    position 0, in consecutive blocks from block 0."""
    from engine.runtime.model_runner import step_arrays

    tables, first = [], 0
    for n in lengths:
        blocks = -(-n // block_size)
        tables.append(list(range(first, first + blocks)))
        first += blocks
    return step_arrays(
        [0] * sum(lengths),
        lengths,
        [0] * len(lengths),
        tables,
        block_size,
        list(range(len(lengths))) if recurrent else None,
    )


def measure_activation_peak(
    model: Model,
    platform,
    build_cache,
    *,
    num_tokens: int,
    max_model_len: int,
    max_num_seqs: int,
    block_size: int,
) -> int:
    """The peak bytes a forward of ``num_tokens`` prompt tokens and the LM head on
    ``max_num_seqs`` rows allocate above what was allocated before it (the weights).
    ``build_cache(max_model_len, num_seqs)`` makes a KV cache just large enough for the
    profile's sequences, which is dropped afterwards (its bytes count in the peak: a slight
    overestimate, on the safe side)."""
    from engine.runtime.model_runner import ModelRunner

    lengths = profile_sequences(num_tokens, max_model_len)
    platform.synchronize()
    platform.reset_peak_memory()
    before, _ = platform.memory_stats()
    kv_cache = build_cache(min(max_model_len, num_tokens), len(lengths))
    runner = ModelRunner(model, kv_cache, platform.device())
    recurrent = any(spec.is_recurrent for spec in model.kv_cache_specs())
    with torch.inference_mode():
        input_ids, positions, common = runner.to_device(profile_arrays(lengths, block_size, recurrent))
        hidden = model(input_ids, positions, kv_cache.forward_context(common))
        rows = min(max_num_seqs, hidden.shape[0])
        model.compute_logits(hidden[-rows:]).float()  # the sampler works on fp32 logits
    platform.synchronize()
    _, peak = platform.memory_stats()
    del runner, kv_cache, hidden
    return max(0, peak - before)
