"""Paged KV cache: a pool of fixed-size blocks per layer, and the block manager that hands them out.

Each sequence owns a block table (list of block ids); token at position p lives in slot
block_table[p // block_size] * block_size + p % block_size. Blocks return to the free list when a
sequence finishes, so memory neither fragments nor grows with the number of requests served.
"""

from __future__ import annotations

from collections import deque

import torch


class OutOfBlocks(Exception):
    """Not enough free blocks right now; the scheduler keeps the request waiting."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.allocations = 0
        self.reuses = 0
        self._ever_used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.free_blocks)

    def ensure_capacity(self, block_table: list[int], num_tokens: int) -> None:
        """Grow `block_table` in place to hold `num_tokens` tokens, or raise OutOfBlocks untouched."""
        missing = self.blocks_needed(num_tokens) - len(block_table)
        if missing <= 0:
            return
        if missing > len(self.free_blocks):
            raise OutOfBlocks(f"need {missing} blocks, {len(self.free_blocks)} free")
        for _ in range(missing):
            block = self.free_blocks.popleft()
            self.allocations += 1
            if block in self._ever_used:
                self.reuses += 1
            self._ever_used.add(block)
            block_table.append(block)

    def free(self, block_table: list[int]) -> None:
        self.free_blocks.extend(block_table)
        block_table.clear()


class KVCache:
    """Per-layer K and V pools shaped [num_blocks * block_size, kv_heads, head_dim]."""

    def __init__(self, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device):
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.block_size = block_size
        self.num_blocks = num_blocks

    @staticmethod
    def bytes_per_token(num_layers, num_kv_heads, head_dim, dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()
