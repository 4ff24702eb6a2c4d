"""The paged KV cache's bookkeeping: fixed-size blocks, a free list, a block table per sequence.

A sequence asks for room one token (or one prefill chunk) at a time; a new
block is taken from the free list only when its last block is full, so at most
block_size - 1 slots per sequence are ever empty. Block 0 is never handed out:
padding rows write their throw-away keys and values there.
"""
from __future__ import annotations

from collections import deque


class OutOfBlocks(RuntimeError):
    """The free list cannot cover a request for blocks; nothing was changed."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_blocks: deque[int] = deque(range(1, num_blocks))
        self.tables: dict[int, list[int]] = {}
        self.num_tokens: dict[int, int] = {}

    @property
    def capacity(self) -> int:
        """Blocks sequences can hold (all but the reserved padding block)."""
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used(self) -> int:
        return self.capacity - self.num_free

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold num_tokens tokens."""
        return -(-num_tokens // self.block_size)

    def extra_blocks(self, seq_id: int, more_tokens: int) -> int:
        """New blocks a sequence needs to hold `more_tokens` more tokens."""
        have = self.num_tokens.get(seq_id, 0)
        return self.blocks_for(have + more_tokens) - len(self.tables.get(seq_id, ()))

    def can_append(self, seq_id: int, more_tokens: int) -> bool:
        return self.extra_blocks(seq_id, more_tokens) <= self.num_free

    def allocate(self, seq_id: int, num_tokens: int) -> list[int]:
        """A block table for a new sequence holding num_tokens tokens."""
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id} already holds blocks; use append")
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        self._check(seq_id, num_tokens)
        self.tables[seq_id], self.num_tokens[seq_id] = [], 0
        return self.append(seq_id, num_tokens)

    def append(self, seq_id: int, more_tokens: int = 1) -> list[int]:
        """Room for `more_tokens` more tokens of a sequence; returns its block table."""
        if seq_id not in self.tables:
            raise KeyError(f"sequence {seq_id} holds no blocks; allocate first")
        self._check(seq_id, more_tokens)
        table = self.tables[seq_id]
        for _ in range(self.extra_blocks(seq_id, more_tokens)):
            table.append(self.free_blocks.popleft())
        self.num_tokens[seq_id] += more_tokens
        return table

    def free(self, seq_id: int) -> None:
        """Return a sequence's blocks to the free list (a no-op for one that holds none)."""
        self.free_blocks.extend(self.tables.pop(seq_id, ()))
        self.num_tokens.pop(seq_id, None)

    def block_table(self, seq_id: int) -> list[int]:
        return self.tables[seq_id]

    def slot(self, seq_id: int, position: int) -> int:
        """Flat cache slot of a sequence's token at `position`."""
        return self.tables[seq_id][position // self.block_size] * self.block_size + position % self.block_size

    def _check(self, seq_id: int, more_tokens: int) -> None:
        need = self.extra_blocks(seq_id, more_tokens)
        if need > self.num_free:
            raise OutOfBlocks(f"sequence {seq_id} needs {need} more blocks, {self.num_free} are free")
