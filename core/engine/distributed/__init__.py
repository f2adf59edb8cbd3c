"""Tensor parallelism over ``torch.distributed``: the group (``parallel_state``) and the
executor that runs one model shard per rank (``executor``)."""

from engine.distributed.parallel_state import (
    TensorParallel,
    get_tp,
    set_tp,
    tensor_parallel,
)

__all__ = ["TensorParallel", "get_tp", "set_tp", "tensor_parallel"]
