"""CUDA graphs for the engine's captured decode steps (``engine.runtime.graphs``): every graph
of one engine draws from one memory pool, so the sizes captured after the largest reuse its
memory."""

from __future__ import annotations

from typing import Callable


class CudaGraphs:
    """A factory of :class:`CudaGraph` sharing one ``torch.cuda`` graph memory pool."""

    def __init__(self) -> None:
        import torch

        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self) -> CudaGraph:
        return CudaGraph(self.pool)


class CudaGraph:
    def __init__(self, pool) -> None:
        import torch

        self.pool = pool
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, fn: Callable):
        """Run ``fn`` under capture on a side stream (as ``torch.cuda.graph`` does) and return
        its output, which :meth:`replay` refills."""
        import torch

        torch.cuda.synchronize()
        with torch.cuda.graph(self.graph, pool=self.pool):
            out = fn()
        torch.cuda.synchronize()
        return out

    def replay(self) -> None:
        self.graph.replay()
