"""Decode graphs on the CPU: a decode forward recorded as the kernels it ran, replayed without
the Python that chose them.

A batched decode step of a small model spends about a tenth of its time in Python between the
kernels (module calls, shape logic, allocations, the linear kernel's choice by row count):
llama58m at 64 sequences, 1.3 ms a step besides 12 ms of kernels. :class:`CpuGraph` runs the
forward once while recording (capture): every call of an engine-cpu native kernel with a
tensor argument, and every aten op that computes (views and allocations leave nothing to
redo: their tensors are kept, with the storage they alias). ``replay()`` calls the recorded
kernels and ops again on the same tensors, the static inputs refilled by
``engine.runtime.graphs.DecodeGraphs``; an op that returned a new tensor writes the recorded
one. The capture is the step's own forward (``capture_on_first_use``), so a batch size costs
nothing until a decode step of that size runs.

A replay repeats only what was recorded, so a forward that decides anything from tensor
values on the host cannot be captured: a read of a tensor's values (``.item()``, ``.tolist()``,
``.numpy()``, a native kernel returning a number), an op whose output shape depends on values
(``nonzero``, boolean indexing, ``unique``, ...) make the capture raise ``UncapturableStep``
(its output computed in full), and decode steps then run eagerly. An op the lists above do
not know (a library's custom op, run whole) may still shape its output by values: a replay
whose op returns another shape than at capture raises ``StaleGraph``, and the step runs
eagerly, as do the steps after it. The tensors a graph keeps (its intermediates) count
against ``memory_budget``; past it, decode steps run eagerly.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.runtime.graphs import StaleGraph, UncapturableStep

# allocations: their tensors are kept, and a replay writes into them
_ALLOCATIONS = {"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::lift_fresh"}
# output shapes that depend on the values of the inputs
_VALUE_SHAPED = {
    "aten::nonzero",
    "aten::masked_select",
    "aten::unique_consecutive",
    "aten::unique_dim",
    "aten::_unique",
    "aten::_unique2",
    "aten::bincount",
    "aten::histc",
}
# what a graph may keep: a sixteenth of the machine's memory
MEMORY_FRACTION = 16


def _returns_only_tensors(func) -> bool:
    for ret in func._schema.returns:
        kind = ret.type
        if isinstance(kind, torch.OptionalType):
            kind = kind.getElementType()
        if isinstance(kind, torch.ListType):
            kind = kind.getElementType()
        if not isinstance(kind, torch.TensorType):
            return False
    return True


def _value_shaped(func, args, kwargs) -> bool:
    name = func._schema.name
    if name == "aten::repeat_interleave":  # by a tensor of counts, unless told the output's size
        return func._overloadname != "self_int" and kwargs.get("output_size") is None
    if name in _VALUE_SHAPED:
        return True
    if name == "aten::index":  # boolean masks select a value-dependent number of elements
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1])
    return False


def _tensors(values) -> list[torch.Tensor]:
    found = []
    for v in values:
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, (tuple, list)):
            found.extend(t for t in v if isinstance(t, torch.Tensor))
    return found


def _aliases_input(out: Any, args: tuple) -> bool:
    """Whether every tensor ``out`` holds is a view of an argument's storage (``contiguous``,
    ``reshape`` and ``to`` may alias or copy, as their inputs' layouts decide)."""
    storages = {t.untyped_storage().data_ptr() for t in _tensors(args)}
    return all(t.untyped_storage().data_ptr() in storages for t in _tensors((out,)))


def _copy_into(recorded: Any, result: Any, call: Callable) -> None:
    """``result`` of a replayed ``call`` into the tensors its capture returned, which must have
    their shapes (a shape that changed means the forward's own work changed: StaleGraph)."""
    targets, values = (recorded, result) if isinstance(recorded, (tuple, list)) else ((recorded,), (result,))
    if len(targets) != len(values):
        raise StaleGraph(f"{_name(call)} returned {len(values)} tensors, {len(targets)} when captured")
    for target, value in zip(targets, values):
        if not isinstance(target, torch.Tensor):
            continue
        if value.shape != target.shape:
            raise StaleGraph(f"{_name(call)} made a {list(value.shape)} tensor, {list(target.shape)} when captured")
        target.copy_(value)


def _name(call: Callable) -> str:
    return call._schema.name if hasattr(call, "_schema") else getattr(call, "__name__", repr(call))


class _Recorder(TorchDispatchMode):
    """Records the capturing thread's aten ops and native kernel calls into ``tape`` as
    ``(callable, args, kwargs, recorded output or None)``; ``refusal`` says why a replay could
    not repeat the forward (None: it can)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # TorchDispatchMode wraps a subclass's __torch_dispatch__ in torch._dynamo.disable unless
        # this says no, and that wrapper imports torch._dynamo (and triton, where installed) at
        # the first op: about 0.7 s inside the first decode step a process captures. A capture
        # never runs under torch.compile, so there is nothing for the wrapper to disable.
        return False

    def __init__(self, tape: list) -> None:
        super().__init__()
        self.tape = tape
        self.refusal: str | None = None
        self.thread = threading.get_ident()
        self.storages: dict[int, int] = {}  # data pointer -> bytes, of the tensors the capture made

    def refuse(self, reason: str) -> None:
        if self.refusal is None:
            self.refusal = reason

    def _keep(self, out: Any) -> None:
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self.storages[storage.data_ptr()] = storage.nbytes()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name
        if name in _ALLOCATIONS:
            self._keep(out)
            return out
        mutates = func._schema.is_mutable
        if not mutates and func.is_view and _aliases_input(out, args):
            return out  # a view: its storage is kept by whatever reads it
        if not _returns_only_tensors(func):
            self.refuse(f"{name} reads a tensor's values on the host")
        elif _value_shaped(func, args, kwargs):
            self.refuse(f"{name} makes a tensor whose shape depends on values")
        if not mutates:
            self._keep(out)
        self.tape.append((func, args, kwargs, None if mutates else out))
        return out

    def native(self, kernel: Callable) -> Callable:
        def recorded(*args):
            out = kernel(*args)
            if threading.get_ident() != self.thread or not _tensors(args):
                return out  # another thread's call, or a query of sizes and support
            returned = out if isinstance(out, (tuple, list)) else () if out is None else (out,)
            if not all(isinstance(t, torch.Tensor) for t in returned):
                self.refuse(f"native {_name(kernel)} returns a value to the host")
            self._keep(out)
            self.tape.append((kernel, args, {}, out))
            return out

        return recorded

    def host_read(self, method: Callable) -> Callable:
        def guarded(tensor, *args, **kwargs):
            if threading.get_ident() == self.thread:
                self.refuse(f"Tensor.{method.__name__} reads a tensor's values on the host")
            return method(tensor, *args, **kwargs)

        return guarded


class CpuGraph:
    """One decode forward, recorded by :meth:`capture` and rerun by :meth:`replay` (see the
    module docstring)."""

    capture_on_first_use = True
    _held = 0  # bytes all graphs of the process keep
    _lock = threading.Lock()
    # one capture at a time: each swaps the kernel modules' functions and two Tensor methods
    _capturing = threading.Lock()

    def __init__(self) -> None:
        self.tape: list[tuple[Callable, tuple, dict, Any]] = []
        self.nbytes = 0

    @classmethod
    def memory_budget(cls) -> int:
        from engine_cpu.platform import read_meminfo

        return read_meminfo().total_bytes // MEMORY_FRACTION

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        with CpuGraph._capturing:
            return self._capture(fn)

    def _capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        from engine_cpu import native

        tape: list = []
        recorder = _Recorder(tape)
        modules = native.loaded_modules()
        originals = [
            (module, name, function)
            for module in modules
            for name, function in vars(module).items()
            if not name.startswith("_") and callable(function) and not isinstance(function, type)
        ]
        # (name, the method, whether torch.Tensor defines it itself rather than inheriting it)
        readers = [(name, getattr(torch.Tensor, name), name in vars(torch.Tensor)) for name in ("tolist", "numpy")]
        try:
            for module, name, kernel in originals:
                setattr(module, name, recorder.native(kernel))
            for name, method, _ in readers:
                setattr(torch.Tensor, name, recorder.host_read(method))
            with recorder:
                output = fn()
        finally:
            for module, name, kernel in originals:
                setattr(module, name, kernel)
            for name, method, own in readers:
                if own:
                    setattr(torch.Tensor, name, method)
                else:
                    delattr(torch.Tensor, name)
        if recorder.refusal is not None:
            raise UncapturableStep(recorder.refusal, output)
        nbytes = sum(recorder.storages.values())
        with CpuGraph._lock:
            if CpuGraph._held + nbytes > self.memory_budget():
                raise UncapturableStep(
                    f"the graphs would keep {(CpuGraph._held + nbytes) / 2**20:.0f} MiB of activations, past "
                    f"1/{MEMORY_FRACTION} of this machine's memory",
                    output,
                )
            CpuGraph._held += nbytes
        self.tape, self.nbytes = tape, nbytes
        return output

    def replay(self) -> None:
        for call, args, kwargs, recorded in self.tape:
            result = call(*args, **kwargs)
            if recorded is not None:
                _copy_into(recorded, result, call)

    def __del__(self) -> None:
        with CpuGraph._lock:
            CpuGraph._held -= self.nbytes
