"""Paged KV cache bookkeeping: a free list of fixed-size blocks and per-sequence tables.

Plain Python, no torch: the model runner turns block tables into slot indices.
"""
from __future__ import annotations

from collections import deque

from specd.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.block_size = block_size
        self.num_total_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow seq's table to hold num_tokens tokens; False (and no change) if blocks run out."""
        extra = self.blocks_needed(num_tokens) - len(seq.block_table)
        if extra > len(self._free):
            return False
        for _ in range(max(extra, 0)):
            seq.block_table.append(self._free.popleft())
        return True

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keep blocks for the first num_tokens tokens only (roll back rejected drafts)."""
        keep = self.blocks_needed(num_tokens)
        while len(seq.block_table) > keep:
            self._free.append(seq.block_table.pop())

    def free(self, seq: Sequence) -> None:
        # In order, so a later sequence tends to get consecutive blocks again: attention then
        # reads a lone sequence's K/V as a view of the cache (specd/engine/attention.py).
        self._free.extend(seq.block_table)
        seq.block_table = []
