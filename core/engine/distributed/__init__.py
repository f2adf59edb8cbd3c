"""Tensor parallelism over ``torch.distributed``: the group (``parallel_state``) and the
executor that runs one model shard per rank (``executor``). ``get_tp``, ``set_tp`` and
``tensor_parallel`` are deprecated (a model takes its group from ``ModelInit.tp``)."""

from engine.distributed.parallel_state import (
    SINGLE,
    TensorParallel,
    get_tp,
    set_tp,
    tensor_parallel,
)

__all__ = ["SINGLE", "TensorParallel", "get_tp", "set_tp", "tensor_parallel"]
