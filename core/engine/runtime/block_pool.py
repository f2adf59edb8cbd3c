"""Paged KV-cache block allocation."""

from __future__ import annotations

from collections import deque

from engine.runtime.request import Request


class BlockPool:
    """Hands out fixed-size cache blocks to requests.

    A request owns ``request.block_ids``; block ``i`` holds its tokens
    ``i*block_size .. (i+1)*block_size-1``.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"The KV cache needs at least one block, got {num_blocks}.")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        total = request.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(request.block_ids))

    def allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Give ``request`` room for ``num_new_tokens`` more tokens; False if out of blocks."""
        needed = self.blocks_needed(request, num_new_tokens)
        if needed > len(self._free):
            return False
        request.block_ids.extend(self._free.popleft() for _ in range(needed))
        return True

    def free(self, request: Request) -> None:
        self._free.extend(request.block_ids)
        request.block_ids = []
